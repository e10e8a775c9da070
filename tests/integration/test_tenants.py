"""API keys against a real server, called the way any gRPC client would (plain stubs with
metadata): who gets in, and what a tenant may ask for."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.client import Client, build_request
from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.protos.v1 import generate_pb2_grpc
from tests.integration.service import Service, health

KEYS = """
tenants:
  paying: {priority: [-2, 0], max_concurrent: 1}
  free: {priority: [1, 2]}
keys:
  - {key: sk-paying, tenant: paying}
  - {key: sk-free, tenant: free}
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("tenants")
    (tmp / "keys.yaml").write_text(KEYS)
    svc = Service(tmp / "serve.log", "--api-keys", str(tmp / "keys.yaml"),
                  "--no-enable-reflection")
    svc.wait_serving()
    yield svc
    svc.stop()


def status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_no_key_or_a_wrong_key_is_unauthenticated_and_health_stays_open(keyed):
    stub = generate_pb2_grpc.GenerationStub(keyed.client.channel)
    req = build_request(text="hi", max_tokens=2)
    for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
        assert status(lambda m=metadata: list(stub.Generate(req, metadata=m, timeout=30))
                      )[0] == grpc.StatusCode.UNAUTHENTICATED
        assert status(lambda m=metadata: stub.GetModelInfo(api.GetModelInfoRequest(),
                                                           metadata=m, timeout=30)
                      )[0] == grpc.StatusCode.UNAUTHENTICATED
    assert health(keyed.client.channel) == health_pb2.HealthCheckResponse.SERVING
    assert keyed.metrics()['pagedserve_num_requests_refused_total{reason="unauthenticated"}'] == 4


def test_a_tenant_gets_served_within_its_bounds(keyed):
    with Client(keyed.address, api_key="sk-paying") as paying:
        text, _, _ = paying.complete(chat=[("user", "What is the capital of France?")],
                                     temperature=0, max_tokens=16)
        assert text == "The capital of France is Paris."
        long = paying.stub.Generate(build_request(text="Count: 1, 2,", max_tokens=300,
                                                  ignore_eos=True), metadata=paying.metadata,
                                    timeout=120)
        next(long)  # running: the tenant's one concurrent request
        code, details = status(lambda: paying.complete(text="hi", max_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "runs 1 requests" in details
        long.cancel()
    with Client(keyed.address, api_key="sk-free") as free:
        code, details = status(lambda: free.complete(text="hi", max_tokens=2, priority=-2))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "(1..2)" in details
        assert free.complete(text="hi", max_tokens=2)[1]  # 0: the tenant's default, 1
    m = keyed.wait_idle()
    assert m['pagedserve_tenant_requests_total{outcome="admitted",tenant="paying"}'] == 2
    assert m['pagedserve_tenant_requests_total{outcome="throttled",tenant="paying"}'] == 1
    assert m['pagedserve_tenant_requests_total{outcome="denied",tenant="free"}'] == 1
    assert m['pagedserve_tenant_generation_tokens_total{tenant="free"}'] == 2
    records = [json.loads(line) for line in keyed.log_path.read_text().splitlines()
               if line.startswith('{"event": "request_finished"')]
    assert [(r["tenant"], r["priority"]) for r in records][-1] == ("free", 1)
