"""`ddtree-lab ingest`: formats recognised by content, settings with their sources, a verdict per
run, bad input reported per file, bounded memory on large files, and the report in a browser."""
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the sample builders beside this file
import ingest_samples as S  # noqa: E402
from ddtree_lab import cli  # noqa: E402
from ddtree_lab.workbench import formats, ingest as I, ingest_report, jsonstream  # noqa: E402


def _by_name(doc):
    return {(Path(r["file"]).name, r["line"]): r for r in doc["runs"]}


# ----------------------------------------------------------------------------- the folder of the issue
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An AR baseline, a good DDTree run, a 122-byte failed run, a garbage run, a truncated file,
    an appended multi-run file and a concurrency-256 partial run."""
    d = tmp_path_factory.mktemp("runs") / "bench"
    d.mkdir()
    ar = S.serving(throughput=1000.0, tpot=30.0, info=S.server_info(), detail=S.details(64, 64))
    (d / "auto_c32.jsonl").write_text(S.jsonl(ar))
    dd_info = S.server_info("DDTREE", budget=8, topk=4, draft_tokens=16, window=2048, accept=3.1)
    dd = S.serving(throughput=2500.0, tpot=12.0, accept=3.1, info=dd_info, detail=S.details(64, 64))
    (d / "ddtree_run.jsonl").write_text(S.jsonl(dd))
    cut = S.jsonl(S.serving(info=dd_info)).encode()[:122]
    (d / "ddtree_b16t4_c32.jsonl").write_bytes(cut)
    junk = ["the the the the " * 40] * 60 + S.good_texts(4)
    garbage = S.serving(throughput=2600.0, accept=3.3, info=S.server_info("DDTREE", budget=32, topk=4, accept=3.3),
                        detail=S.details(64, 64, texts=junk))
    (d / "garbage.jsonl").write_text(S.jsonl(garbage))
    whole = S.jsonl(S.serving(info=S.server_info("DDTREE", budget=64, topk=4), accept=3.5,
                              detail=S.details(64, 64)))
    (d / "truncated_b64.jsonl").write_text(whole[: len(whole) // 2])
    info = S.server_info("DDTREE", budget=16, topk=4, accept=3.0, seed=99)
    (d / "sweep_c1_c4_c16.jsonl").write_text(S.jsonl(*(S.serving(concurrency=c, throughput=300.0 * c, accept=a,
                                                                 info=info) for c, a in ((1, 3.0), (4, 3.2),
                                                                                          (16, 3.4)))))
    sub = d / "high_load"
    sub.mkdir()
    (sub / "ddtree_b8t4.jsonl").write_text(S.jsonl(S.serving(concurrency=256, completed=200, accept=2.9,
                                                             info=dd_info, detail=S.details(256, 200))))
    return d


@pytest.fixture(scope="module")
def doc(folder):
    return I.ingest([folder])


def test_folder_verdicts(doc):
    runs = _by_name(doc)
    assert {k: r["verdict"] for k, r in runs.items()} == {
        ("auto_c32.jsonl", 1): "ok", ("ddtree_run.jsonl", 1): "ok", ("ddtree_b16t4_c32.jsonl", 1): "failed",
        ("garbage.jsonl", 1): "garbage", ("truncated_b64.jsonl", 1): "truncated",
        ("sweep_c1_c4_c16.jsonl", 1): "ok", ("sweep_c1_c4_c16.jsonl", 2): "suspect",
        ("sweep_c1_c4_c16.jsonl", 3): "suspect", ("ddtree_b8t4.jsonl", 1): "partial"}
    assert "122 bytes" in runs["ddtree_b16t4_c32.jsonl", 1]["reason"]
    assert "long repeats" in runs["garbage.jsonl", 1]["reason"] and "60 of 64" in runs["garbage.jsonl", 1]["reason"]
    assert "ends inside this record" in runs["truncated_b64.jsonl", 1]["reason"]
    partial = runs["ddtree_b8t4.jsonl", 1]
    assert "200 of 256" in partial["reason"] and "Connection reset" in partial["reason"]
    assert (partial["completed"], partial["failed"], partial["concurrency"]) == (200, 56, 256)
    assert "run 1 in this file" in runs["sweep_c1_c4_c16.jsonl", 3]["reason"]
    assert doc["unrecognised"] == []


def test_folder_settings_and_sources(doc):
    runs = _by_name(doc)
    dd = runs["ddtree_run.jsonl", 1]
    assert (dd["engine"], dd["tool"], dd["model"], dd["method"]) == ("sglang", "sglang bench_serving", "Qwen/Qwen3-8B", "ddtree")
    assert (dd["budget"], dd["topk"], dd["draft_window"], dd["concurrency"], dd["tp"]) == (8, 4, 2048, 32, 1)
    assert dd["sources"] == {"model": "server_info", "method": "server_info", "budget": "server_info",
                             "topk": "server_info", "draft_window": "server_info", "concurrency": "fields",
                             "tp": "server_info"}
    assert dd["accept_length"] == pytest.approx(3.1) and dd["speedup_over_ar"] == pytest.approx(2.5)
    ar = runs["auto_c32.jsonl", 1]
    assert ar["method"] == "ar" and ar["accept_length"] is None and ar["speedup_over_ar"] == pytest.approx(1.0)
    # the failed file holds the first 122 bytes of a record: what it got to, else its name
    failed = runs["ddtree_b16t4_c32.jsonl", 1]
    assert (failed["method"], failed["budget"], failed["topk"], failed["concurrency"]) == ("ddtree", 16, 4, 32)
    assert failed["sources"] == {"method": "filename", "budget": "filename", "topk": "filename",
                                 "concurrency": "fields"}
    assert failed["tool"] == "sglang bench_serving" and failed["completed"] is None
    # the record's own fields win over the file name (c1_c4_c16 in the name, 4 in the record)
    assert runs["sweep_c1_c4_c16.jsonl", 2]["concurrency"] == 4
    assert runs["sweep_c1_c4_c16.jsonl", 2]["sources"]["concurrency"] == "fields"
    # no speedup for runs that are not usable, nor where no AR run matches (concurrency 256)
    assert runs["garbage.jsonl", 1]["speedup_over_ar"] is None and runs["ddtree_b8t4.jsonl", 1]["speedup_over_ar"] is None
    for r in doc["runs"]:
        assert list(r) == list(I.RUN_KEYS), r["file"]


def test_external_json_contract(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["ingest", str(folder), "--out", str(out)]) == 0
    got = json.loads((out / "external.json").read_text())
    assert got["schema"] == 1 and set(got) == {"schema", "runs", "unrecognised"}
    assert len(got["runs"]) == 9 and (out / "report.html").stat().st_size > 1_000_000
    assert "9 run(s): 3 ok, 2 suspect, 1 partial, 1 garbage, 1 truncated, 1 failed" in capsys.readouterr().out
    assert not list(out.glob(".*tmp*"))  # atomic writes leave no temp files
    # ingesting again with --out inside the input folder skips the outputs
    assert cli.main(["ingest", str(folder.parent), "--out", str(folder.parent / "ext")]) == 0
    again = json.loads((folder.parent / "ext" / "external.json").read_text())
    assert len(again["runs"]) == 9 and again["unrecognised"] == []
    shutil.rmtree(folder.parent / "ext")


def test_user_mistakes_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["ingest", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file or folder" in err and "Traceback" not in err
    (tmp_path / "f").write_text("x")
    assert cli.main(["ingest", str(tmp_path), "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file" in err


# ----------------------------------------------------------------------------- formats
def test_three_serving_field_sets(tmp_path):
    info = S.server_info("EAGLE", topk=8, steps=3, draft_tokens=32, tp=8)
    (tmp_path / "old.jsonl").write_text(S.jsonl(S.serving("older", accept=2.5)))
    (tmp_path / "new.jsonl").write_text(S.jsonl(S.serving("newer", accept=2.5, info=info, tag="x")))
    (tmp_path / "ref.jsonl").write_text(S.jsonl(S.serving("refactored", completed=10, accept=2.5,
                                                          detail=S.details(12, 10))))
    runs = _by_name(I.ingest([tmp_path]))
    assert runs["old.jsonl", 1]["tool"] == runs["ref.jsonl", 1]["tool"] == "sglang bench_serving"
    old, new, ref = runs["old.jsonl", 1], runs["new.jsonl", 1], runs["ref.jsonl", 1]
    assert old["verdict"] == "ok" and old["method"] is None and old["accept_length"] == 2.5
    assert (new["method"], new["budget"], new["topk"], new["tp"]) == ("eagle", 32, 8, 8)
    # refactored keys (total_input / total_output) and details nested under `details`
    assert ref["verdict"] == "partial" and (ref["completed"], ref["failed"]) == (10, 2)


def test_one_batch_and_bench_serve(tmp_path):
    (tmp_path / "ob_ddtree_b16t8.jsonl").write_text(S.jsonl(S.one_batch(acc_length=3.7), S.one_batch(acc_length=3.9)))
    (tmp_path / "ob_auto.jsonl").write_text(S.jsonl(S.one_batch(acc_length=-1)))
    (tmp_path / "ob_plain.jsonl").write_text(S.jsonl(S.one_batch(acc_length=-1)))
    (tmp_path / "serve_dflash_b15.json").write_text(json.dumps(S.bench_serve(detail=S.details(100, 100))))
    (tmp_path / "serve_pretty.json").write_text(json.dumps(S.bench_serve(spec=False), indent=2))
    (tmp_path / "serve_meta.json").write_text(json.dumps(S.bench_serve(method="DDTree", budget="32", topk="8", hardware="H200")))
    (tmp_path / "serve_failed.json").write_text(json.dumps(S.bench_serve(completed=90, failed=10)))
    runs = _by_name(I.ingest([tmp_path]))
    ob = runs["ob_ddtree_b16t8.jsonl", 1]
    assert (ob["tool"], ob["method"], ob["budget"], ob["topk"], ob["concurrency"]) == \
           ("sglang bench_one_batch_server", "ddtree", 16, 8, 16)
    assert ob["accept_length"] == 3.7 and ob["mean_tpot_ms"] == pytest.approx(1e3 * 16 / 1200)
    assert runs["ob_ddtree_b16t8.jsonl", 2]["verdict"] == "suspect"
    ar = runs["ob_auto.jsonl", 1]
    assert ar["method"] == "ar" and ar["accept_length"] is None and ar["sources"]["method"] == "filename"
    assert runs["ob_plain.jsonl", 1]["method"] == "ar" and runs["ob_plain.jsonl", 1]["sources"]["method"] == "fields"
    v = runs["serve_dflash_b15.json", 1]
    assert (v["engine"], v["tool"], v["method"], v["budget"], v["model"]) == \
           ("vllm", "vllm bench serve", "dflash", 15, "meta-llama/Llama-3.1-8B-Instruct")
    assert v["verdict"] == "ok" and v["accept_length"] == 2.8 and v["sources"]["method"] == "filename"
    meta = runs["serve_meta.json", 1]  # --metadata method=DDTree budget=32 topk=8 hardware=H200
    assert (meta["method"], meta["budget"], meta["topk"]) == ("ddtree", 32, 8) and meta["sources"]["budget"] == "fields"
    pretty = runs["serve_pretty.json", 1]
    assert pretty["method"] == "ar" and pretty["verdict"] == "ok"
    assert pretty["speedup_over_ar"] == 1.0 and v["speedup_over_ar"] == 1.0  # same engine, model, concurrency
    assert runs["serve_failed.json", 1]["verdict"] == "partial" and runs["serve_failed.json", 1]["failed"] == 10


def test_infinity_nan_all_failed(tmp_path):
    rec = S.serving(completed=0, out_tokens=0, detail=S.details(8, 0))
    for k in [k for k in rec if k.endswith("_ms")]:
        rec[k] = float("nan")
    (tmp_path / "dead.jsonl").write_text(S.jsonl(rec))
    text = (tmp_path / "dead.jsonl").read_text()
    assert "NaN" in text and "Infinity" in text
    r = I.ingest([tmp_path])["runs"][0]
    assert r["verdict"] == "failed" and "completed == 0" in r["reason"] and r["mean_tpot_ms"] is None
    rec = S.serving(completed=8, detail=S.details(8, 0))  # a count that disagrees with the errors
    (tmp_path / "dead.jsonl").write_text(S.jsonl(rec))
    r = I.ingest([tmp_path])["runs"][0]
    assert r["verdict"] == "failed" and "every request is an error (8)" in r["reason"]


def test_garbage_rules():
    assert I.degenerate_reason("") == "empty text"
    assert I.degenerate_reason("ab" * 200) == "long repeats"
    assert I.degenerate_reason("!?.,;:" * 10) == "mostly punctuation"
    assert I.degenerate_reason("aaaaaaaaaaaaaaaaaaaaaaaaab") == "one character"
    for t in S.good_texts(20):
        assert I.degenerate_reason(t) is None
    r = json.loads(S.jsonl(S.serving(out_tokens=16384, retok=64)))
    assert formats.recognise(r)[1] == "sglang bench_serving"


def test_retokenized_ratio_garbage(tmp_path):
    (tmp_path / "aborted.jsonl").write_text(S.jsonl(S.serving(out_tokens=16384, retok=64)))
    r = I.ingest([tmp_path])["runs"][0]
    assert r["verdict"] == "garbage" and "0.004" in r["reason"]


def test_dp_rank0_accept_length_suspect(tmp_path):
    (tmp_path / "dp.jsonl").write_text(S.jsonl(S.serving(accept=3.0, info=S.server_info("DDTREE", budget=8, dp=4))))
    r = I.ingest([tmp_path])["runs"][0]
    assert r["verdict"] == "suspect" and "rank 0" in r["reason"]


def test_filename_patterns(tmp_path):
    p = tmp_path / "h200" / "ddtree-b8t4_w2048_c256_nvls_tp8.jsonl"
    got = formats.name_settings(p, tmp_path)
    assert got == {"hardware": "h200", "method": "ddtree", "budget": 8, "topk": 4, "draft_window": 2048,
                   "concurrency": 256, "nvls": True, "tp": 8}
    assert formats.name_settings(tmp_path / "auto_c64.jsonl", tmp_path) == {"method": "ar", "concurrency": 64}
    assert formats.name_settings(tmp_path / "cubic_wide.jsonl", tmp_path) == {}  # tokens match whole or not at all


# ----------------------------------------------------------------------------- bad input
def test_bad_input_one_message_each(tmp_path, monkeypatch):
    good = tmp_path / "good.jsonl"
    good.write_text(S.jsonl(S.serving(info=S.server_info())))
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "other.json").write_text(json.dumps({"hello": [1, 2, 3]}))
    (tmp_path / "notes.txt").write_text("this run crashed before it wrote anything useful\n" * 30)
    (tmp_path / "secret.jsonl").write_text(S.jsonl(S.serving()))
    (tmp_path / "self").symlink_to(tmp_path / "self")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up").symlink_to(tmp_path)   # a folder loop
    (tmp_path / "empty").mkdir()
    real_open = I._open

    def guarded(path):
        if path.endswith("secret.jsonl"):
            raise PermissionError(13, "Permission denied")
        return real_open(path)
    monkeypatch.setattr(I, "_open", guarded)
    doc = I.ingest([tmp_path])
    assert [Path(r["file"]).name for r in doc["runs"]] == ["good.jsonl"] and doc["runs"][0]["verdict"] == "ok"
    why = {Path(n["file"]).name: n["reason"] for n in doc["unrecognised"]}
    assert why.pop("blob.bin").startswith("binary")
    assert "no known format (hello)" in why.pop("other.json")
    assert "not JSON" in why.pop("notes.txt")
    assert "Permission denied" in why.pop("secret.jsonl")
    assert why.pop("self") == "symlink loop"
    assert "symlink loop" in why.pop("up")
    assert why.pop("empty") == "empty folder"
    assert why == {}
    empty = tmp_path / "empty"
    assert I.ingest([empty])["unrecognised"] == [{"file": str(empty), "reason": "empty folder: no files to ingest"}]
    locked = tmp_path / "locked"
    locked.mkdir()
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda d: (_ for _ in ()).throw(PermissionError(13, "Permission denied", str(d)))
                        if str(d) == str(locked) else real_scandir(d))
    assert I.ingest([locked])["unrecognised"][0] == {"file": str(locked), "reason": "unreadable folder: Permission denied"}


def test_a_symlink_loop_is_named_by_the_platforms_errno(tmp_path, monkeypatch):
    link = tmp_path / "self"
    link.symlink_to(link)
    monkeypatch.setattr(errno, "ELOOP", 62)  # macOS and the BSDs number ELOOP 62, Linux 40
    monkeypatch.setattr(Path, "stat", lambda self, **kw: (_ for _ in ()).throw(OSError(62, "Too many levels")))
    assert I._link_problem(link) == "symlink loop"


def test_a_name_that_is_not_utf8_is_one_message_and_the_rest_is_ingested(tmp_path, capsys):
    good = S.jsonl(S.serving(info=S.server_info()))
    src = tmp_path / "in"
    src.mkdir()
    (src / "good.jsonl").write_text(good)
    bad_file = src / os.fsdecode(b"run_\xff.json")     # Python holds the byte as a lone surrogate
    bad_file.write_text(good)
    bad_folder = src / os.fsdecode(b"c\xe9")
    bad_folder.mkdir()
    (bad_folder / "inner.jsonl").write_text(good)
    out = tmp_path / "out"
    assert cli.main(["ingest", str(src), "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    got = json.loads((out / "external.json").read_text(encoding="utf-8"))
    assert [Path(r["file"]).name for r in got["runs"]] == ["good.jsonl"]
    assert sorted(Path(n["file"]).name for n in got["unrecognised"]) == ["c\\xe9", "run_\\xff.json"]
    assert len(err) == 2 and any("run_\\xff.json" in line for line in err) and any("c\\xe9" in line for line in err)
    assert (out / "report.html").read_text(encoding="utf-8").count("run_\\xff.json") >= 1
    # named on the command line itself
    doc = I.ingest([bad_file])
    assert doc["runs"] == [] and [n["file"] for n in doc["unrecognised"]] == [I.shown(bad_file)]


def test_a_stray_latin1_byte_is_a_replacement_character_not_a_binary_file(tmp_path):
    texts = S.good_texts(4)
    latin = S.jsonl(S.serving(info=S.server_info(model="caf_model"), detail=S.details(4, 4, texts=texts)))
    (tmp_path / "sglang.jsonl").write_bytes(latin.encode().replace(b"caf_model", b"caf\xe9"))
    serve = json.dumps(S.bench_serve(detail=S.details(4, 4)), indent=2).encode()
    (tmp_path / "vllm.json").write_bytes(serve.replace(b"meta-llama/", b"m\xe9ta/", 1))
    # a text Python decoded with surrogateescape: json.dumps writes its byte as a lone surrogate escape
    escaped = json.dumps(S.serving(info=S.server_info(), detail=S.details(4, 4, texts=["ab\udcffcd " * 30] * 4)))
    (tmp_path / "escaped.jsonl").write_text(escaped + "\n")
    (tmp_path / "noise.bin").write_bytes(bytes(b for b in os.urandom(16384) if b)[:8192])  # no NUL byte
    doc = I.ingest([tmp_path])
    runs = _by_name(doc)
    assert {k: r["verdict"] for k, r in runs.items()} == {("sglang.jsonl", 1): "ok", ("vllm.json", 1): "ok",
                                                          ("escaped.jsonl", 1): "ok"}
    assert runs["sglang.jsonl", 1]["model"] == "caf\ufffd"
    assert runs["vllm.json", 1]["model"] == "m\ufffdta/Llama-3.1-8B-Instruct"
    assert [(n["file"].endswith("noise.bin"), n["reason"].startswith("binary")) for n in doc["unrecognised"]] \
        == [(True, True)]


def test_stray_bytes_and_lone_surrogates_at_chunk_boundaries():
    import io
    rec = {"model_id": "naïve <stray>", "tag": "é" * 50 + "<lone>", "generated_texts": ["é" * 50, "<stray>"],
           "errors": ["", "boom"]}
    data = json.dumps(rec, ensure_ascii=False).encode().replace(b"<stray>", b"\xe9").replace(b"<lone>", b"\\udcff")
    data += b"\n"
    ref = next(jsonstream.read_lines(io.BytesIO(data), I.degenerate_reason))
    assert ref.error is None and ref.value["model_id"] == "naïve \ufffd" and ref.value["tag"] == "é" * 50 + "\ufffd"
    assert ref.details.texts == 2 and ref.details.errors == 1
    for chunk in (1, 2, 3, 7, 64):
        old, jsonstream.CHUNK = jsonstream.CHUNK, chunk
        try:
            lines = next(jsonstream.read_lines(io.BytesIO(data), I.degenerate_reason))
            doc = next(jsonstream.read_document(io.BytesIO(data), I.degenerate_reason))
        finally:
            jsonstream.CHUNK = old
        for got in (lines, doc):  # a character cut by a chunk end is whole again, the stray byte U+FFFD
            assert repr(got.value) == repr(ref.value) and got.details == ref.details, chunk


def test_appended_file_cut_in_its_last_record(tmp_path):
    whole = S.jsonl(S.serving(concurrency=1), S.serving(concurrency=2), S.serving(concurrency=4))
    (tmp_path / "sweep.jsonl").write_text(whole[: len(whole) - 300])
    runs = I.ingest([tmp_path])["runs"]
    assert [(r["line"], r["verdict"], r["concurrency"]) for r in runs] == [(1, "ok", 1), (2, "ok", 2),
                                                                            (3, "truncated", 4)]


def test_a_record_of_backend_completed_0_and_error_is_a_failed_run(tmp_path):
    """What the serving benchmark writes for a run that failed before measuring: failed, settings from the name,
    the error shown; not JSON of no known format."""
    rec = {"backend": "sglang", "completed": 0, "error": "Server disconnected without sending a response."}
    (tmp_path / "ddtree_b16t4_c32.jsonl").write_text(S.jsonl(rec))
    doc = I.ingest([tmp_path])
    assert doc["unrecognised"] == []
    [r] = doc["runs"]
    assert (r["tool"], r["verdict"], r["method"], r["budget"], r["topk"], r["concurrency"]) == \
           ("sglang bench_serving", "failed", "ddtree", 16, 4, 32)
    assert r["sources"] == {"method": "filename", "budget": "filename", "topk": "filename", "concurrency": "filename"}
    assert "completed == 0" in r["reason"] and "Server disconnected without sending" in r["reason"]
    assert r["completed"] == 0 and r["output_throughput"] is None
    # an error with completed > 0 is no such record: of no known format as before
    (tmp_path / "ddtree_b16t4_c32.jsonl").write_text(S.jsonl({**rec, "completed": 3}))
    assert I.ingest([tmp_path])["runs"] == []


def test_a_record_cut_off_keeps_its_fields_and_is_truncated_not_failed(tmp_path):
    """Cut after its results, in a file under TINY_FILE_BYTES or mid-file: truncated, with completed and throughput."""
    text = json.dumps(S.serving("older", completed=60, throughput=1234.5))
    cut = text[: text.index('"output_throughput"') + 30]
    assert len(cut) < I.TINY_FILE_BYTES
    (tmp_path / "ddtree_b8t4.jsonl").write_text(cut)
    first, second = S.jsonl(S.serving(concurrency=1)), S.jsonl(S.serving(concurrency=2, throughput=777.0))
    (tmp_path / "sweep.jsonl").write_text(first + second[:600] + "\n" + S.jsonl(S.serving(concurrency=4)))
    runs = _by_name(I.ingest([tmp_path]))
    small = runs["ddtree_b8t4.jsonl", 1]
    assert (small["verdict"], small["completed"], small["output_throughput"], small["budget"], small["topk"]) == \
           ("truncated", 60, 1234.5, 8, 4)
    assert "ends inside this record" in small["reason"]
    mid = runs["sweep.jsonl", 2]
    assert (mid["verdict"], mid["completed"], mid["concurrency"]) == ("truncated", 64, 2)
    assert "cut off mid-file" in mid["reason"] and "ends inside" not in mid["reason"]
    assert [runs["sweep.jsonl", n]["verdict"] for n in (1, 3)] == ["ok", "ok"]


def test_mid_file_bad_line_keeps_the_rest(tmp_path):
    (tmp_path / "mixed.jsonl").write_text(S.jsonl(S.serving()) + "garbage line\n" + S.jsonl(S.serving()))
    doc = I.ingest([tmp_path])
    assert [r["line"] for r in doc["runs"]] == [1, 3]
    assert doc["unrecognised"][0]["reason"].startswith("line 2: not JSON")


# ----------------------------------------------------------------------------- large files
def _big_record(n_req: int) -> dict:
    texts = S.good_texts(n_req, words=600)
    return S.serving(completed=n_req, out_tokens=256 * n_req, detail={**S.details(n_req, n_req, texts=texts),
                     "itls": [[0.0123456] * 32 for _ in range(n_req)]}, info=S.server_info("DDTREE", budget=8))


def test_large_detail_file_bounded_memory(tmp_path):
    """A single line of ~40 MB (details of 8000 requests): peak Python memory stays a few MB."""
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write(json.dumps(_big_record(8000)) + "\n")
    assert big.stat().st_size > 30e6
    tracemalloc.start()
    try:
        runs, notes = I.ingest_file(big, tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert notes == [] and len(runs) == 1 and runs[0].verdict == "ok"
    assert runs[0].extra["details"].counts["itls"] == 8000 and runs[0].extra["details"].texts == 8000
    assert peak < 6e6, peak
    # the same as one pretty-printed document, read as a document, with the whole process measured
    big.write_text(json.dumps(_big_record(8000), indent=1))
    code = ("import resource, sys; from pathlib import Path; from ddtree_lab.workbench import ingest as I;"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
            "runs, _ = I.ingest_file(Path(sys.argv[1]), None); assert runs[0].verdict == 'ok', runs[0].reason;"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)")
    env = {**os.environ, "PYTHONPATH": str(Path(I.__file__).parents[2])}
    res = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout.split()[-1]) * 1024 < 30e6  # KiB on Linux; the file is over 40 MB


def test_nan_filter_chunk_boundaries():
    rec = {"a": float("inf"), "b": float("nan"), "s": 'Infinity "q" \\"NaN', "z": -float("inf"),
           "generated_texts": ["x NaN", "ab" * 200], "errors": ["", "boom"]}
    data = (json.dumps(rec) + "\n").encode()
    import io
    ref = next(jsonstream.read_lines(io.BytesIO(data), I.degenerate_reason))
    for chunk in (1, 2, 3, 7, 64):
        old, jsonstream.CHUNK = jsonstream.CHUNK, chunk
        try:
            got = next(jsonstream.read_lines(io.BytesIO(data), I.degenerate_reason))
        finally:
            jsonstream.CHUNK = old
        assert repr(got.value) == repr(ref.value) and got.details == ref.details, chunk
    assert ref.value["s"] == rec["s"] and ref.value["z"] == -float("inf")
    assert ref.details.errors == 1 and ref.details.degenerate == {"long repeats": 1}


def test_ingest_module_is_torch_free():
    import ast
    for mod in (I, formats, jsonstream):
        tree = ast.parse(Path(mod.__file__).read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert not names & {"torch", "triton", "numpy", "plotly"}, (mod.__name__, names)
        rel = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
        assert rel <= {"atomic", "formats", "jsonstream", "external", "advisor.machines", "routing", "routing_dumps",
                       "routing_formats", None}, rel  # the GPU table; routing dumps (test_routing holds them torch-free)


# ----------------------------------------------------------------------------- study and report
def test_study_external_field(tmp_path, folder):
    from ddtree_lab.workbench.spec import StudyError, parse_study
    base = {"name": "s", "models": {"pair": "lab"}, "prompts": {"set": "lab:code"}, "methods": ["ar"],
            "grid": {"budget": [4]}}
    st = parse_study({**base, "external": [str(folder)]}, check_files=False)
    assert st.external == [str(folder.resolve())] and st.to_json()["external"] == st.external
    assert parse_study(base, check_files=False).external == []
    with pytest.raises(StudyError, match=r"external\[0\]"):
        parse_study({**base, "external": [str(tmp_path / "missing")]}, check_files=True)
    with pytest.raises(StudyError, match="external"):
        parse_study({**base, "external": [3]}, check_files=False)


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, tiny_dirs, tiny_pair, folder):
    """AR + DDTree b4/b8 runs of the tiny pair, and the folder under `external:`."""
    from ddtree_lab.workbench import results as R
    from ddtree_lab.atomic import atomic_write_json
    from ddtree_lab.workbench.runs import RunParams
    root = tmp_path_factory.mktemp("ext_study")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n"}))
    sd = root / "study"
    t, d = tiny_dirs
    p = RunParams(study_name="ext", study_dir=str(sd), pair="", target_dir=str(t), drafter_dir=str(d),
                  prompt_set=str(prompts), n_prompts=1, max_new_tokens=8, warmup=False, topk=4)
    R.quick_sweep(p, [8, 16], tiny_pair)
    atomic_write_json(sd / "study.json", {"study": {"name": "ext", "methods": ["ar", "ddtree"],
                                                    "external": [str(folder)]},
                                          "runs": ["ar-t0", "ddtree-b8-k4-t0", "ddtree-b16-k4-t0"]})
    return sd


def test_study_report_shows_both(study_dir):
    from ddtree_lab.workbench import report
    page = report.build_report(study_dir).read_text()
    assert "Runs measured by serving stacks" in page and "workbench vs serving stacks" in page
    assert page.count("plotly.js v") == 1
    m = re.search(r"<h2 id=\"ext-compare\".*?</table>", page, re.S)
    assert m and "ddtree-b8-k4-t0" in m.group(0) and "3.10 (sglang, ddtree_run.jsonl:1)" in m.group(0)


def test_external_json_in_study_dir(study_dir, tmp_path):
    """Without `external:` in the study, an external.json beside the runs joins the report."""
    from ddtree_lab.workbench import report
    sj = json.loads((study_dir / "study.json").read_text())
    paths = sj["study"].pop("external")
    (study_dir / "study.json").write_text(json.dumps(sj))
    try:
        assert "Runs measured by serving stacks" not in report.build_report(study_dir, tmp_path / "a.html").read_text()
        (study_dir / "external.json").write_text(json.dumps(I.ingest(paths)))
        page = report.build_report(study_dir, tmp_path / "b.html").read_text()
        assert "Runs measured by serving stacks" in page and "truncated_b64.jsonl" in page
    finally:
        sj["study"]["external"] = paths
        (study_dir / "study.json").write_text(json.dumps(sj))
        (study_dir / "external.json").unlink(missing_ok=True)


def _chromium():
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def _render(page: Path, tmp_path: Path) -> str:
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000",
             "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()]
    dom = subprocess.run(flags, capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Uncaught" not in dom.stderr, [l for l in dom.stderr.splitlines() if "CONSOLE" in l]
    m = re.search(r'id="render-status"[^>]*data-plots="(\d+)"[^>]*data-errors="(\d+)"', dom.stdout) or \
        re.search(r'data-plots="(\d+)"[^>]*data-errors="(\d+)"[^>]*id="render-status"', dom.stdout)
    assert m, "the page's load hook did not run"
    assert int(m.group(2)) == 0, dom.stdout[dom.stdout.find("render-status"):][:800]
    assert int(m.group(1)) == page.read_text().count('class="fig"') > 0  # every figure drew its SVG
    return dom.stdout


def test_ingest_report_in_headless_chromium(doc, tmp_path):
    page = ingest_report.write_page(doc, tmp_path / "report.html", I.THRESHOLDS)
    dom = _render(page, tmp_path)
    titles = re.findall(r'class="gtitle"[^>]*>(.*?)</text>', dom)
    assert titles == [ingest_report.METRICS[m][0] for m in ("output_throughput", "mean_tpot_ms", "accept_length",
                                                            "speedup_over_ar")]
    for text in ("garbage.jsonl:1", "long repeats", "200 of 256", "REPEAT_COMPRESS_RATIO", "ends inside this record"):
        assert text in dom, text


def test_study_report_in_headless_chromium(study_dir, tmp_path):
    from ddtree_lab.workbench import report
    dom = _render(report.build_report(study_dir, tmp_path / "r.html"), tmp_path)
    titles = re.findall(r'class="gtitle"[^>]*>(.*?)</text>', dom)
    assert "τ per budget: measured here vs reported by serving stacks" in titles
    assert "acceptance length vs budget (serving stacks)" in titles


def test_the_serving_figures_label_their_budget_axis_at_each_budget():
    """Budgets that are not powers of two (24, 48) get a tick as well: no plotly minor digits, no gaps."""
    runs = [{"file": "r.jsonl", "line": i + 1, "engine": "sglang", "verdict": "ok", "model": "m", "method": "ddtree",
             "budget": b, "topk": 4, "concurrency": 8, "tp": 1, "output_throughput": 100.0 + b, "accept_length": 2.0,
             "speedup_over_ar": 1.1, "mean_tpot_ms": 9.0, "hardware": "h200", "nvls": False}
            for i, b in enumerate((8, 24, 48, 64))]
    mine = [{"run": "ddtree-b16", "method": "ddtree", "topk": None, "budget": 16, "tau": 2.5}]
    for fig in (ingest_report.sweep_figure(runs, "output_throughput"), ingest_report.compare_figure(mine, runs)):
        axis = fig.layout.xaxis
        drawn = sorted({x for trace in fig.data for x in trace.x})
        assert axis.type == "log" and list(axis.tickvals) == drawn and list(axis.ticktext) == [str(b) for b in drawn]


def test_study_report_shows_a_routing_json_beside_the_runs(study_dir, tmp_path):
    """routing.json in the study directory (ingest's --out there) joins the study's report: table and figures."""
    import routing_samples as RS
    from ddtree_lab.workbench import report, routing_report
    (tmp_path / "v.json").write_text(json.dumps(RS.vllm_chat(RS.routed(40, 2, 2, 16, seed=1))))
    routing = I.ingest_all([tmp_path / "v.json"])[1]
    (study_dir / "routing.json").write_text(json.dumps(routing))
    try:
        html = report.build_report(study_dir, tmp_path / "r.html").read_text()
    finally:
        (study_dir / "routing.json").unlink()
    assert "MoE routing from routing dumps" in html and "v.json" in html
    titles = [f["layout"]["title"]["text"] for f in report.page_figures(html)]
    assert routing_report.touched_figure(routing).layout.title.text in titles
    assert routing_report.ranks_figure(routing).layout.title.text in titles
    assert "MoE routing from routing dumps" not in report.build_report(study_dir, tmp_path / "s.html").read_text()


def test_routing_page_in_headless_chromium(tmp_path):
    import routing_samples as RS
    from ddtree_lab.workbench import routing_report
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "v.jsonl").write_text(RS.jsonl(RS.vllm_chat(RS.routed(300, 3, 2, 32, seed=2, pool=8)),
                                                      RS.vllm_chat(RS.routed(5, 3, 1, 32, seed=3))))
    out = tmp_path / "out"
    assert cli.main(["ingest", str(tmp_path / "in"), "--out", str(out)]) == 0
    dom = _render(out / "report.html", tmp_path)
    titles = re.findall(r'class="gtitle"[^>]*>(.*?)</text>', dom)
    assert routing_report.touched_figure({"files": []}).layout.title.text in titles
    assert routing_report.ranks_figure({"files": []}).layout.title.text in titles
    assert "top_k 1 where the file" in dom  # the refused sequence, in the page's table
