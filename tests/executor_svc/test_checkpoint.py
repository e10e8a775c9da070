"""Which files of a model folder the loader reads (checkpoint_files): HF safetensors, else
pytorch_model*.bin, the shards an index names, never a second layout of the same weights; a
model loaded from each equals HF transformers."""

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.executor.checkpoint import CheckpointFilesError, checkpoint_files
from tests.executor_svc.test_hf_fallback import CHUNKS, SEQS, paged, saved
from tests.executor_svc.test_model import assert_paged_equals_hf

LLAMA = dict(model_type="llama")


def bins(hf, path, sharded: bool):
    """The model written as pytorch_model.bin (as older checkpoints are), or as two shards and
    their index as transformers names them."""
    import json

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for f in path.glob("*.safetensors*"):
        f.unlink()
    if not sharded:
        torch.save(state, path / "pytorch_model.bin")
        return
    names = sorted(state)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(parts, 1):
        file = f"pytorch_model-0000{i}-of-00002.bin"
        torch.save({n: state[n] for n in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_model_bin_loads_and_equals_hf(sharded, tmp_path):
    hf = saved(LLAMA, tmp_path)
    bins(hf, tmp_path, sharded)
    files = [f.name for f in checkpoint_files(tmp_path)]
    assert files == (["pytorch_model.bin"] if not sharded else
                     ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"])
    outs, _ = paged(tmp_path, "native")
    assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)


def test_a_second_layout_beside_the_hf_one_is_left_alone(tmp_path):
    """Mistral's repos hold consolidated.safetensors (its own names) beside the HF shards."""
    hf = saved(LLAMA, tmp_path)
    save_file({"layers.0.attention.wq.weight": torch.ones(2, 2)},
              tmp_path / "consolidated.safetensors")
    assert [f.name for f in checkpoint_files(tmp_path)] == ["model.safetensors"]
    outs, _ = paged(tmp_path, "native")
    assert_paged_equals_hf(hf, outs, SEQS, CHUNKS)


def test_an_index_names_the_shards_read(tmp_path):
    """A stale shard the index does not name (a re-download's leftover) is not read."""
    import json

    saved(LLAMA, tmp_path)
    save_file({"model.norm.weight": torch.zeros(64)}, tmp_path / "model-old.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model.safetensors"}}))
    assert [f.name for f in checkpoint_files(tmp_path)] == ["model.safetensors"]


def test_a_folder_without_weights_is_named(tmp_path):
    (tmp_path / "training_args.bin").write_bytes(b"x")
    with pytest.raises(CheckpointFilesError, match="no \\*.safetensors or pytorch_model\\*.bin "
                                                   f"weights in {tmp_path}"):
        checkpoint_files(tmp_path)
