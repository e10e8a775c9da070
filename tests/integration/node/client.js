// A Node client (grpc-js) of the standard gRPC services, with the protos that ship in the npm
// packages (nothing of pagedserve's):
//   node client.js watch ADDRESS SERVICE     one line per Health/Watch status, until killed
//   node client.js reflect ADDRESS VERSION   v1 or v1alpha: one JSON line with the listed
//                                            services and the file that defines Generation
'use strict';
const path = require('path');
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');

function load(file, pkg) {
  const def = loader.loadSync(file, {keepCase: true, longs: String, enums: String});
  return pkg.split('.').reduce((o, k) => o[k], grpc.loadPackageDefinition(def));
}

function watch(address, service) {
  const proto = path.join(path.dirname(require.resolve('grpc-health-check/package.json')),
                          'proto/health/v1/health.proto');
  const Health = load(proto, 'grpc.health.v1').Health;
  const call = new Health(address, grpc.credentials.createInsecure()).Watch({service});
  call.on('data', (r) => console.log(r.status));
  call.on('error', (e) => { console.log(`ERROR ${e.code} ${e.details}`); process.exit(1); });
}

function reflect(address, version) {
  const root = path.dirname(require.resolve('@grpc/reflection/package.json'));
  const proto = path.join(root, `build/proto/grpc/reflection/${version}/reflection.proto`);
  const Reflection = load(proto, `grpc.reflection.${version}`).ServerReflection;
  const call = new Reflection(address, grpc.credentials.createInsecure()).ServerReflectionInfo();
  const out = {};
  call.on('data', (r) => {
    if (r.list_services_response) out.services = r.list_services_response.service.map((s) => s.name);
    if (r.file_descriptor_response) out.files = r.file_descriptor_response.file_descriptor_proto.length;
    if (r.error_response) out.error = r.error_response.error_message;
  });
  call.on('error', (e) => { console.log(JSON.stringify({code: e.code, details: e.details})); process.exit(1); });
  call.on('end', () => console.log(JSON.stringify(out)));
  call.write({list_services: ''});
  call.write({file_containing_symbol: 'pagedserve.v1.Generation'});
  call.end();
}

const [command, address, arg] = process.argv.slice(2);
({watch, reflect})[command](address, arg);
