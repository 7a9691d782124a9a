"""A resume whose data block differs from its checkpoint's (another corpus, another sequence length)
is refused like a changed rate: one line naming each key with both values, nothing trained."""

import json
import shutil

from launch_helpers import launch, run_config


def test_a_resume_on_another_corpus_and_sequence_length_is_refused(corpus, tmp_path):
    """Killed after its first checkpoint (global step 3), run again on a copy of its corpus under
    another ``data.prefix`` (a corpus that exists and reads) and with ``data.seq_length`` 16 instead
    of 32: refused in one line naming both keys, metrics untouched."""
    config = run_config(tmp_path, corpus, "run")
    assert launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step4"}).returncode != 0
    other = tmp_path / "copy" / "gpt"
    other.parent.mkdir()
    for suffix in (".bin", ".idx", ".meta.json"):
        shutil.copy(corpus["gpt"] + suffix, str(other) + suffix)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    refused = launch(config, f"data.prefix={other}", "data.seq_length=16")
    assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        f"error: the checkpoint phase00-step0000003 in {tmp_path / 'run'} was written by another config "
        f"(data.prefix {json.dumps(corpus['gpt'])} -> {json.dumps(str(other))}, data.seq_length 32 -> 16): run its "
        f"config, use another training.output_dir, or pass --allow-config-change to change it from there on "
        f"(recorded in config_changes.jsonl)"], refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing written
