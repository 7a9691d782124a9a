"""Every reader of files from outside runs nothing a file names.

In each file a reader (or a tool) takes from someone else, a payload is planted whose unpickling
would create a marker file (a shell command, as a malicious checkpoint would run); the reader
refuses it with one line naming the file and what it asked for, and the marker never appears.
Each case then shows the payload is live: a plain unpickling of the same file creates the marker.
"""

import json
import os
import pickle
import shutil

import numpy
import pytest
import torch

from launch_helpers import convert, small_config as run_config_file


class Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def one_line(text: str, *words) -> str:
    """``text`` (an error, or a tool's stderr) is one line holding every one of ``words``."""
    text = str(text).strip()
    assert "\n" not in text, text
    for word in words:
        assert str(word) in text, (word, text)
    return text


@pytest.fixture(scope="module")
def torch_dist(tmp_path_factory, dist_single):
    """A Megatron-LM save directory (torch_dist, iteration 3) of a small GPT, written by this project."""
    from conftest import random_state_dict, small_config
    from megatron_multilevel.checkpoints import megatron_dist

    cfg = small_config("gpt_tied", num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64)
    save = tmp_path_factory.mktemp("torch_dist") / "save"
    megatron_dist.write(str(save), random_state_dict(cfg), cfg, iteration=3)
    return save


def _copy(save, tmp_path):
    copy = tmp_path / "save"
    shutil.copytree(save, copy)
    return copy, copy / "iter_0000003"


def _metadata(directory):
    from megatron_multilevel.checkpoints import safe_dist

    return safe_dist.read_metadata(str(directory))


def test_a_payload_in_the_metadata_is_refused_before_anything_runs(torch_dist, tmp_path):
    """The user's report: ``from-megatron`` and ``init-run`` of a checkpoint whose ``.metadata``
    runs a shell command when unpickled (from-megatron through the tool, init-run in process): both
    refuse in one line, and the command never runs."""
    from megatron_multilevel.checkpoints import megatron_dist
    from megatron_multilevel.checkpoints.init_run import init_run

    marker = tmp_path / "ran"
    save, directory = _copy(torch_dist, tmp_path)
    metadata = _metadata(directory)
    metadata.planner_data = Payload(marker)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    config = run_config_file(tmp_path / "run.json", kind="gpt", prefix="unused", tokenizer_model="unused",
                             output_dir=tmp_path / "run", model={"num_layers": 2, "hidden_size": 32,
                                                                 "num_attention_heads": 2, "vocab_size": 64})
    for read in (lambda: megatron_dist.read(str(save)),
                 lambda: init_run(str(save), str(config), str(tmp_path / "run"))):
        with pytest.raises(ValueError) as refused:
            read()
        assert not marker.exists()
        one_line(refused.value, f"refused to read {directory / '.metadata'}: it asks to load posix.system")
    result = convert("from-megatron", save, tmp_path / "full")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    one_line(result.stderr, f"error: refused to read {directory / '.metadata'}: it asks to load posix.system",
             "nothing from it was run")
    assert not marker.exists()
    assert not (tmp_path / "full").exists() and not (tmp_path / "run").exists()
    with open(directory / ".metadata", "rb") as f:  # the payload is live
        pickle.load(f)
    assert marker.exists()


def test_a_payload_in_a_shard_is_refused_in_one_line(torch_dist, tmp_path):
    """A ``.distcp`` shard whose tensor items unpickle a payload (its ``.metadata`` clean)."""
    from megatron_multilevel.checkpoints import megatron_dist

    marker = tmp_path / "ran"
    save, directory = _copy(torch_dist, tmp_path)
    shard = directory / "__0_0.distcp"
    torch.save(Payload(marker), shard)
    metadata = _metadata(directory)
    for info in metadata.storage_data.values():  # every item of the shard: the payload
        if info.relative_path == shard.name:
            info.offset, info.length = 0, shard.stat().st_size
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError) as refused:
        megatron_dist.read(str(save))
    one_line(refused.value, f"refused to read {shard}: it asks to load posix.system", "nothing from it was run")
    result = convert("from-megatron", save, tmp_path / "full")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    one_line(result.stderr, f"error: refused to read {shard}: it asks to load posix.system")
    assert not marker.exists()
    torch.load(shard, weights_only=False)  # the payload is live
    assert marker.exists()


def test_a_shard_outside_the_checkpoint_is_refused(torch_dist, tmp_path):
    from megatron_multilevel.checkpoints import megatron_dist

    save, directory = _copy(torch_dist, tmp_path)
    metadata = _metadata(directory)
    next(iter(metadata.storage_data.values())).relative_path = "../../elsewhere.distcp"
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError) as refused:
        megatron_dist.read(str(save))
    one_line(refused.value, f"refused to read {directory / '.metadata'}: it places a shard at '../../elsewhere.distcp'")


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_payload_in_the_common_state_is_refused(torch_dist, tmp_path, zipped):
    from megatron_multilevel.checkpoints import megatron_dist, safe_dist

    marker = tmp_path / "ran"
    save, directory = _copy(torch_dist, tmp_path)
    common = safe_dist.load_common(str(directory))
    common["args"] = Payload(marker)
    torch.save(common, directory / "common.pt", _use_new_zipfile_serialization=zipped)
    with pytest.raises(ValueError) as refused:
        megatron_dist.read(str(save))
    one_line(refused.value, f"refused to read {directory / 'common.pt'}: it asks to load posix.system",
             "(argparse.Namespace)")
    assert not marker.exists()
    torch.load(directory / "common.pt", weights_only=False)
    assert marker.exists()


def _hf_config(directory):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16).save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_payload_in_a_hugging_face_pickle_is_refused(tmp_path, zipped):
    from megatron_multilevel.checkpoints.convert import from_hf

    marker, src = tmp_path / "ran", tmp_path / "hf"
    _hf_config(src)
    torch.save({"transformer.wte.weight": torch.zeros(64, 16), "x": Payload(marker)}, src / "pytorch_model.bin",
               _use_new_zipfile_serialization=zipped)
    with pytest.raises(ValueError) as refused:
        from_hf(str(src), str(tmp_path / "out"), fmt="safetensors", overwrite=False)
    one_line(refused.value, f"refused to read {src / 'pytorch_model.bin'}: it asks to load posix.system",
             "tensors and containers only")
    assert not marker.exists() and not (tmp_path / "out").exists()
    torch.load(src / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_hugging_face_safetensors_are_read_rather_than_a_pickle_beside_them(tmp_path, dist_single):
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_multilevel.checkpoints.convert import from_hf, hf_pickled_weights

    marker, src = tmp_path / "ran", tmp_path / "hf"
    config = _hf_config(src)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config.from_pretrained(src)).save_pretrained(src)
    torch.save({"x": Payload(marker)}, src / "pytorch_model.bin")
    assert hf_pickled_weights(str(src), config) == []
    from_hf(str(src), str(tmp_path / "out"), fmt="safetensors", overwrite=False)
    assert (tmp_path / "out" / "model.safetensors").is_file() and not marker.exists()
    # a config that names the pickle is read from it, so the pickle is checked first
    assert hf_pickled_weights(str(src), {**config, "transformers_weights": "pytorch_model.bin"}) == [
        str(src / "pytorch_model.bin")]
    with pytest.raises(ValueError) as refused:
        hf_pickled_weights(str(src), {**config, "transformers_weights": "../elsewhere.bin"})
    one_line(refused.value, "names the weights file '../elsewhere.bin', not a file inside it")


def test_legacy_pickles_are_refused_like_zip_files(tmp_path):
    """torch's legacy (non-zip) format, in a DeepSpeed file and a consolidated checkpoint."""
    from conftest import small_config
    from megatron_multilevel.checkpoints.full import FILES, load_full, save_full
    from megatron_multilevel.training.safe_load import load_checkpoint_file

    marker = tmp_path / "ran"
    legacy = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "x": Payload(marker)}, legacy, _use_new_zipfile_serialization=False)
    for mmap in (False, True):
        with pytest.raises(ValueError) as refused:
            load_checkpoint_file(str(legacy), mmap=mmap)
        one_line(refused.value, f"refused to read {legacy}: it asks to load posix.system, which is not among the "
                                f"classes a DeepSpeed checkpoint of this project holds")
    full = tmp_path / "full"
    save_full(str(full), {"w": torch.zeros(2)}, small_config("gpt_tied"), fmt="torch")
    torch.save({"w": torch.zeros(2), "x": Payload(marker)}, full / FILES["torch"], _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError) as refused:
        load_full(str(full))
    one_line(refused.value, f"refused to read {full / FILES['torch']}: it asks to load posix.system")
    assert not marker.exists()
    torch.load(legacy, weights_only=False)
    assert marker.exists()


def _sidecar(path, **state):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": 1, "state": {"open_levels": {}, **state}}))


@pytest.mark.parametrize("tag", ["../..", "/tmp", ""])
def test_a_latest_pointer_that_leaves_the_checkpoints_is_refused(tmp_path, tag):
    from megatron_multilevel.checkpoints.deepspeed_reader import open_checkpoint
    from megatron_multilevel.training.checkpoint import read_latest

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text(tag)
    _sidecar(tmp_path / "multilevel.json")  # where ``../..`` leads: a sidecar that would be read
    pointer = run / "checkpoints" / "latest"
    for read in (read_latest, open_checkpoint):
        with pytest.raises(ValueError) as refused:
            read(str(run))
        one_line(refused.value, f"{pointer} names the checkpoint {tag!r}, which is not a directory inside")


def test_a_sidecar_whose_open_level_leaves_the_checkpoints_is_refused(tmp_path):
    from megatron_multilevel.training.checkpoint import read_latest

    run = tmp_path / "run"
    _sidecar(run / "checkpoints" / "phase01-step0000002" / "multilevel.json", open_levels={"1": "../../x"})
    (run / "checkpoints" / "latest").write_text("phase01-step0000002")
    with pytest.raises(ValueError) as refused:
        read_latest(str(run))
    one_line(refused.value, "phase01-step0000002/multilevel.json names the checkpoint '../../x'")
    result = convert("to-full", run, tmp_path / "out")
    assert result.returncode == 2, result.stderr[-2000:]
    one_line(result.stderr, "error: ", "names the checkpoint '../../x', which is not a directory inside")


def test_json_configs_and_sidecars_that_are_not_small_objects_are_refused(torch_dist, tmp_path):
    from megatron_multilevel.checkpoints import megatron_dist
    from megatron_multilevel.checkpoints.full import is_full
    from megatron_multilevel.checkpoints.init_run import init_run
    from megatron_multilevel.checkpoints.megatron_convert import from_megatron
    from megatron_multilevel.config.parsing import MAX_JSON_BYTES
    from megatron_multilevel.training.checkpoint import read_latest

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    for call in (lambda: init_run(str(torch_dist), str(listed), str(tmp_path / "run")),
                 lambda: from_megatron(str(torch_dist), str(tmp_path / "out"), config=str(listed), fmt="torch",
                                       overwrite=False)):
        with pytest.raises(ValueError) as refused:
            call()
        one_line(refused.value, f"{listed}: expected a JSON object at the top level, got list")
    huge = tmp_path / "huge.json"
    with open(huge, "w") as f:
        f.truncate(MAX_JSON_BYTES + 1)
    with pytest.raises(ValueError) as refused:
        init_run(str(torch_dist), str(huge), str(tmp_path / "run"))
    one_line(refused.value, f"{huge}: {MAX_JSON_BYTES + 1:,} bytes, more than the {MAX_JSON_BYTES:,}", "refused unread")
    # a checkpoint's own JSON: a run's sidecar, a consolidated checkpoint's, Megatron-Core's metadata.json
    save, directory = _copy(torch_dist, tmp_path)
    (directory / "metadata.json").write_text('"torch_dist"')
    with pytest.raises(ValueError) as refused:
        megatron_dist.is_torch_dist(str(save))
    one_line(refused.value, f"{directory / 'metadata.json'}: expected a JSON object at the top level, got str")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "checkpoint.json").write_text("[]")
    with pytest.raises(ValueError) as refused:
        is_full(str(tmp_path / "full"))
    one_line(refused.value, "checkpoint.json: expected a JSON object at the top level, got list")
    sidecar = tmp_path / "run2" / "checkpoints" / "phase00-step0000001" / "multilevel.json"
    _sidecar(sidecar)
    (sidecar.parent.parent / "latest").write_text("phase00-step0000001")
    os.truncate(sidecar, MAX_JSON_BYTES + 1)
    with pytest.raises(ValueError) as refused:
        read_latest(str(tmp_path / "run2"))
    one_line(refused.value, f"checkpoint {sidecar} is unreadable", "refused unread")


def test_a_pickle_in_megatrons_cache_of_sample_indices_is_refused(tmp_path):
    """Megatron-Core loads its cached sample indices with ``numpy.load(allow_pickle=True)``."""
    from megatron_multilevel.data.datasets import check_index_cache

    marker, cache = tmp_path / "ran", tmp_path / "index"
    cache.mkdir()
    numpy.save(cache / "a-GPTDataset-train-sample_index.npy", numpy.arange(6, dtype=numpy.int32).reshape(3, 2))
    check_index_cache(str(cache))  # plain arrays pass
    planted = cache / "a-GPTDataset-train-shuffle_index.npy"
    with open(planted, "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(ValueError) as refused:
        check_index_cache(str(cache))
    one_line(refused.value, f"refused to read {planted}: Megatron-Core's cached sample index is not a plain .npy array")
    numpy.save(planted, numpy.array([Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError) as refused:
        check_index_cache(str(cache))
    one_line(refused.value, f"refused to read {planted}", "(an array of Python objects)")
    assert not marker.exists()
    numpy.load(planted, allow_pickle=True)  # as Megatron-Core loads it (without mmap: an object array)
    assert marker.exists()
