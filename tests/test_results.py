"""benchmarks/results/ stays an archive: few small files, no raw sweeps, and a REPORT.md that is
what `python -m benchmarks.report` makes of the records (no GPU needed)."""

from __future__ import annotations

import json
import lzma
import subprocess

from benchmarks import report
from benchmarks.common import RESULTS

# the report: one screenful a section; 390 since the FP8-cache prefill rows, the fallback and
# the API processes beside the native W1 runs (375 at 22de8b9)
MAX_FILES, MAX_BYTES, MAX_REPORT_LINES = 40, 2 * 2**20, 390


def _files() -> set:
    """Every file under results/ that git tracks or that is there (a run's new records)."""
    root = RESULTS.parents[1]
    listed = subprocess.run(["git", "ls-files", "-z", "--", str(RESULTS)], cwd=root,
                            capture_output=True, text=True).stdout
    return {root / p for p in listed.split("\0") if p} | {
        p for p in RESULTS.rglob("*") if p.is_file()}


def test_results_hold_at_most_40_files_and_2_mib():
    files = _files()
    size = sum(p.stat().st_size for p in files if p.exists())
    assert len(files) <= MAX_FILES, sorted(str(p.relative_to(RESULTS)) for p in files)
    assert size <= MAX_BYTES, f"{size:,} bytes: summarise sweeps, archive raw data (xz)"


def test_report_is_short_and_what_the_records_make():
    text = report.report()
    assert len(text.splitlines()) <= MAX_REPORT_LINES
    assert text == (RESULTS / "REPORT.md").read_text(), "run `python -m benchmarks.report`"
    for name in report.PLOTS:
        assert (RESULTS / name).exists(), name


def test_no_raw_sweep_is_kept_in_the_records():
    for family in report.SWEEPS:
        raw = [r for r in report.load(family) if report.raw_sweep(family, r)]
        assert not raw, f"{family}: `python -m benchmarks.report --summarise-sweeps`"


def _sweep(run: str, rows: int, ms: float, cfg: str, impl: str = "sweep") -> dict:
    return {"recorded_at": f"{run}:00Z", "run": run, "commit": "c0ffee", "kind": "w4a16_gemm",
            "method": "awq", "impl": impl, "config": cfg, "group_size": 128, "rows": rows,
            "n": 4096, "k": 4096, "ms": ms}


def test_a_sweep_becomes_its_fastest_correct_config_per_shape_and_run(tmp_path):
    day1, day2 = "2026-11-29T10:00", "2026-11-30T10:00"
    recs = [{**_sweep(day1, 1, 0.02, "-", "default")},
            _sweep(day1, 1, 0.03, "a"), _sweep(day1, 1, 0.01, "b", "sweep_wrong"),
            _sweep(day1, 1, float("inf"), "c"), _sweep(day1, 16, 0.05, "a"),
            _sweep(day1, 1, 0.025, "d"), _sweep(day2, 1, 0.04, "a")]
    lines = [json.dumps(r) for r in recs]
    path = tmp_path / "w4a16_gemm.jsonl"
    path.write_text("\n".join(lines) + "\n")

    assert report.summarise_sweeps("w4a16_gemm", tmp_path) == 3
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["run"], r["rows"], r["impl"], r["config"]) for r in kept] == [
        (day1, 1, "default", "-"), (day1, 1, "sweep", "d"), (day1, 16, "sweep", "a"),
        (day2, 1, "sweep", "a")]
    assert [(r.get("sweep_configs"), r.get("sweep_wrong")) for r in kept] == [
        (None, None), (4, 2), (1, 0), (1, 0)]
    assert kept[1]["sweep_archive"] == "archive/2026-11-29_w4a16_gemm_sweeps.jsonl.xz"
    archived = {day: lzma.decompress((tmp_path / "archive" / f"{day[:10]}_w4a16_gemm_sweeps"
                                      ".jsonl.xz").read_bytes()).decode().splitlines()
                for day in (day1, day2)}
    assert archived == {day1: lines[1:6], day2: lines[6:]}

    before = path.read_text()
    assert report.summarise_sweeps("w4a16_gemm", tmp_path) == 0  # nothing raw is left
    assert path.read_text() == before


def test_newest_keeps_the_latest_record_of_each_key_where_the_key_first_appeared():
    recs = [{"k": "a", "recorded_at": "1", "v": 1}, {"k": "b", "recorded_at": "2", "v": 2},
            {"k": "a", "recorded_at": "3", "v": 3}, {"k": "b", "recorded_at": "0", "v": 4}]
    assert [r["v"] for r in report.newest(recs, lambda r: r["k"])] == [3, 2]


def test_superseded_records_move_to_the_archive_by_day_and_the_newest_stay(tmp_path):
    day1, day2 = "2026-11-29T10:00", "2026-11-30T10:00"
    recs = [_sweep(day1, 1, 0.02, "-", "default"), _sweep(day1, 16, 0.05, "-", "default"),
            _sweep(day1, 1, 0.01, "-", "torch_matmul"), _sweep(day2, 1, 0.03, "-", "default"),
            {**_sweep(day2, 1, 0.04, "-", "default"), "method": "gptq"}]
    lines = [json.dumps(r) for r in recs]
    path = tmp_path / "w4a16_gemm.jsonl"
    path.write_text("\n".join(lines) + "\n")

    assert report.archive_superseded("w4a16_gemm", tmp_path) == 1
    assert path.read_text().splitlines() == [lines[1], lines[2], lines[3], lines[4]]
    archived = lzma.decompress((tmp_path / "archive" / "2026-11-29_w4a16_gemm_superseded"
                                ".jsonl.xz").read_bytes()).decode().splitlines()
    assert archived == [lines[0]]
    assert report.archive_superseded("w4a16_gemm", tmp_path) == 0
    assert not (tmp_path / "archive" / "2026-11-30_w4a16_gemm_superseded.jsonl.xz").exists()


def test_kernel_rows_differing_in_their_last_number_merge():
    """One row per kind, shape family and reference, at the first one's place; a unit said
    once; compound rates and other shapes left alone."""
    rows = [["gemv", "q M=1", "0.0088", "2.38 TB/s", "cublas", "0.0098", "2.14 TB/s", "a1"],
            ["ceiling_copy", "4 GiB", "-", "-", "torch", "1.7", "2.44 TB/s", "a1"],
            ["gemv", "q M=4", "0.0134", "1.57 TB/s", "cublas", "0.0099", "2.12 TB/s", "b2"],
            ["fused_moe", "x T=1", "0.03", "2.5 TB/s / 2.5 TFLOP/s", "-", "-", "-", "a1"],
            ["fused_moe", "x T=4", "0.05", "3.0 TB/s / 9.0 TFLOP/s", "-", "-", "-", "a1"],
            ["gemv", "q M=2", "0.0098", "-", "other", "-", "-", "a1"]]
    assert report._merge_sizes(rows) == [
        ["gemv", "q M=1/4", "0.0088 / 0.0134", "2.38 / 1.57 TB/s", "cublas", "0.0098 / 0.0099",
         "2.14 / 2.12 TB/s", "a1 b2"],
        rows[1], rows[3], rows[4], rows[5]]


def test_throughput_table_leaves_profiles_and_older_experiments_to_the_records():
    """A profiled run, and a run with PAGEDSERVE_* switches of an older commit than the newest
    such run of its workload and model, are in no row; the rest each are."""
    def run(commit, at, env=None, flags=""):
        return {"engine": "pagedserve", "workload": "W1", "model": "m", "gpu": "NVIDIA H100",
                "recorded_at": f"2026-12-06T{at}:00Z", "commit": commit, "env": env or {},
                "server_flags": flags, "command": "throughput.py", "output_tok_s": 100.0,
                "run": f"throughput_{at}"}
    records = [run("old1", "06:00", {"PAGEDSERVE_X": "1"}), run("old1", "06:01"),
               run("new2", "22:00", {"PAGEDSERVE_Y": "0"}),
               run("new2", "22:01", {"PAGEDSERVE_Y": "1"}),
               run("new2", "22:02", flags="--torch-profile-dir /tmp/p")]
    text = "\n".join(report.throughput_section(records))
    commits = [line.split(" | ")[-2] for line in text.splitlines() if line.startswith("| W1")]
    assert commits == ["old1", "new2", "new2"]
    assert "PAGEDSERVE_X" not in text and "torch profile" not in text


def test_targets_take_the_api_processes_auto_makes_and_an_ab_runs_after_side():
    """The goals' rows read runs at the flags a user gets: `--api-server-count 2` (auto on the
    16-core H200 host) counts, the single-process baseline of an A/B call and other flags do
    not."""
    def run(at, flags, ab=None, fraction=0.5):
        r = {"engine": "pagedserve", "workload": "W1", "model": "llama3.2-1b",
             "gpu": "NVIDIA H200", "recorded_at": f"2026-12-06T{at}:00Z", "commit": at,
             "server_flags": flags, "output_tok_s": 100.0, "roofline_fraction": fraction,
             "command": "throughput.py --max-num-seqs 0 --max-num-batched-tokens 0",
             "run": f"throughput_{at}"}
        return r | ({"ab": ab} if ab else {})
    records = [run("01", "", fraction=0.41), run("02", "--api-server-count 2", "current"),
               run("03", "--api-server-count 0", "baseline"),
               run("04", "--api-server-count 4"), run("05", "--stream-interval 8")]
    rows = [line for line in report.defaults_section(records, [])
            if line.startswith("| W1 llama3.2-1b")]
    assert [row.split(" | ")[2:4] for row in rows] == [["0.50 (100 out tok/s)", "02"]]
