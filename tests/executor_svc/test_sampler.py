import torch

from pagedserve.executor.sampler import Sampler, SamplingSpec, position_seed

CPU = torch.device("cpu")


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    assert Sampler(CPU)(x, [SamplingSpec()] * 4, [0] * 4) == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(rows=3)
    spec = SamplingSpec(temperature=1.0, seed=1234)
    alone = Sampler(CPU)(x[1:2], [spec], [17])
    batch = Sampler(CPU)(x, [SamplingSpec(temperature=0.7), spec, SamplingSpec(temperature=1.3)],
                         [5, 17, 9])
    assert batch[1] == alone[0]
    again = [Sampler(CPU)(x[1:2], [spec], [17])[0] for _ in range(3)]
    assert again == [alone[0]] * 3


def test_seeded_draws_vary_with_position():
    x = torch.zeros(1, 1000)  # uniform: any fixed token for all positions would be a bug
    spec = SamplingSpec(temperature=1.0, seed=7)
    draws = {Sampler(CPU)(x, [spec], [p])[0] for p in range(20)}
    assert len(draws) > 10


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits()
    s = Sampler(CPU, seed=0)
    greedy = x.argmax(-1).tolist()
    assert s(x, [SamplingSpec(temperature=1.0, top_k=1)] * 4, [0] * 4) == greedy
    assert s(x, [SamplingSpec(temperature=1.0, top_p=1e-6)] * 4, [0] * 4) == greedy


def test_top_k_and_top_p_restrict_the_support():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(CPU, seed=0)
    top_k = {s(x, [SamplingSpec(temperature=1.0, top_k=2)], [0])[0] for _ in range(200)}
    assert top_k == {0, 1}
    # top_p 0.8: {0.5, 0.3} reach 0.8 -> token 2 and 3 are cut
    top_p = {s(x, [SamplingSpec(temperature=1.0, top_p=0.8)], [0])[0] for _ in range(200)}
    assert top_p == {0, 1}


def test_sampling_follows_the_distribution():
    x = torch.log(torch.tensor([[0.25, 0.75]]))
    spec = [SamplingSpec(temperature=1.0, seed=99)]
    ones = sum(Sampler(CPU)(x, spec, [p])[0] for p in range(4000))
    assert 0.72 < ones / 4000 < 0.78


def test_seeds_a_power_of_two_apart_do_not_alias():
    x = torch.zeros(1, 1000)  # uniform: the draw is the generator's alone
    for a, b in ((5, 5 + 2**63), (0, 2**63), (7, 7 + 2**32)):
        draws = [[Sampler(CPU)(x, [SamplingSpec(temperature=1.0, seed=s)], [p])[0]
                  for p in range(8)] for s in (a, b)]
        assert draws[0] != draws[1], (a, b)
    assert len({position_seed(s, 3) for s in (1, 1 + 2**63, 2**64 - 1)}) == 3
