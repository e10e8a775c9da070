from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pagedserve.scheduler.metrics import BatchHistogram


def test_batch_histogram_exports_what_one_observe_per_value_would():
    values = [0.0, 0.001, 0.005, 0.0051, 0.1, 2.5, 99.0, 0.005]  # on, between, past the bounds
    buckets = (0.001, 0.005, 0.1, 1.0)
    texts = []
    for batched in (False, True):
        reg = CollectorRegistry()
        if batched:
            h = BatchHistogram("x", "x", {"model_name": "m"}, buckets, reg)
            h.observe_many(values[:3])
            h.observe_many(values[3:])
        else:
            child = Histogram("x", "x", ["model_name"], buckets=buckets,
                              registry=reg).labels("m")
            for v in values:
                child.observe(v)
        texts.append([line for line in generate_latest(reg).decode().splitlines()
                      if "x_created" not in line])  # served with created series off
    assert 'x_bucket{le="0.005",model_name="m"} 4.0' in texts[0]
    assert 'x_count{model_name="m"} 8.0' in texts[0]
    assert texts[0] == texts[1]
