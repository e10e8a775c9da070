

def test_observe_many_equals_one_observe_per_value():
    from pagedserve.scheduler.metrics import observe_many
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    values = [0.0, 0.001, 0.005, 0.0051, 0.1, 2.5, 99.0, 0.005]  # on, between, past the bounds
    texts = []
    for batched in (False, True):
        reg = CollectorRegistry()
        h = Histogram("x", "x", buckets=(0.001, 0.005, 0.1, 1.0), registry=reg)
        if batched:
            observe_many(h, values)
        else:
            for v in values:
                h.observe(v)
        texts.append([line for line in generate_latest(reg).decode().splitlines()
                      if not line.startswith("x_created")])
    assert 'x_bucket{le="0.005"} 4.0' in texts[0] and "x_count 8.0" in texts[0]
    assert texts[0] == texts[1]
