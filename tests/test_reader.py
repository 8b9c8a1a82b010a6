"""The text reader that the four text-reading scripts share, tested once.

A reader function that stands in several scripts is the same in each (tests/test_copies.py), so the bad-input
table runs in-process against one copy, train_bpe_cpu.py's; one command line run per kind of error shows it
reaching the user as a single `error:` line. Byte ranges are train_bpe_multigpu.py's alone: its ranks split
the files.
"""
import importlib.util
import json
import os
import random
import re
import socket
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"{name}_for_reader_tests", REPO / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reader = load_script("train_bpe_cpu.py")
ranges = load_script("train_bpe_multigpu.py")  # the reader with byte ranges


def read(data, budget=10**9):
    return list(reader.first_chars(reader.open_source(str(data), True)[0], budget))


# ---------------------------------------------------------------- good input: the same documents, byte for byte


def test_txt_jsonl_parquet_and_a_directory(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = ["First\r\ndocument.\r\n", "Second one, with ünïcode.", "Third: 中文 and 😀"]
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(docs[0].encode())  # CRLF kept: rustbpe sees the bytes as they are
    (folder / "b.jsonl").write_text(json.dumps({"text": docs[1], "id": 1}) + "\n\n  \n")
    pq.write_table(pa.table({"text": [docs[2]], "id": [7]}), folder / "c.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "d.parquet")  # no rows: no documents
    (folder / "notes.md").write_text("not read: not a text source")
    assert read(folder / "a.txt") == docs[:1]
    assert read(folder / "b.jsonl") == docs[1:2]
    assert read(folder / "c.parquet") == docs[2:]
    assert read(folder / "d.parquet") == []
    assert read(folder) == docs  # a directory: its text files in sorted order
    assert read(folder, 8) == ["First\r\nd"]


def test_a_jsonl_file_may_start_with_a_utf8_bom(tmp_path):  # as Windows tools write it, and `datasets` reads it
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert read(tmp_path / "bom.jsonl") == ["first", "second"]


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good \xff\xfe and \xe2\x82 more " + "real \ufffd".encode())
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "x\xff"}\n')
    reader.BadUTF8.count = 0
    assert read(tmp_path / "bad.txt") == ["good \ufffd\ufffd and \ufffd more real \ufffd"]
    assert read(tmp_path / "bad.jsonl") == ["x\ufffd"]
    assert reader.BadUTF8.count == 4  # three in the .txt (the real U+FFFD is not one), one in the .jsonl


# "\ud800" is valid JSON, but json.loads makes it a lone surrogate, which has no UTF-8 encoding: like an invalid
# UTF-8 byte, each becomes U+FFFD and counts. An escaped pair is one real character (😀) and stays.
LONE_SURROGATES = r'{"text": "lone \ud800, \uDC00\ud800; paired \ud83d\ude00 \u00fc \ufffd"}' + "\n" + r'{"text": "real \ufffd"}' + "\n"


def test_a_lone_surrogate_escape_is_replaced_and_counted(tmp_path):
    (tmp_path / "lone.jsonl").write_text(LONE_SURROGATES)
    reader.BadUTF8.count = 0
    assert read(tmp_path / "lone.jsonl") == ["lone \ufffd, \ufffd\ufffd; paired \U0001f600 ü \ufffd", "real \ufffd"]
    assert reader.BadUTF8.count == 3  # the U+FFFD that the second document holds is no error


def test_a_lone_surrogate_is_a_warning_on_the_command_line(tmp_path):
    (tmp_path / "lone.jsonl").write_text(LONE_SURROGATES * 50)
    result = subprocess.run([sys.executable, str(REPO / "train_bpe_cpu.py"), "--data", "lone.jsonl", "-v", "260", "--out", "tok"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "warning: 150 invalid UTF-8 sequences were replaced with U+FFFD" in result.stderr


def test_a_txt_file_is_read_only_as_far_as_the_budget_needs(tmp_path):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # a terabyte of zeros on no disk: only a reader that stops at its budget returns
    assert list(reader.read_txt(huge, 5)) == ["\0" * 5]


def test_byte_ranges_read_every_line_exactly_once(tmp_path):
    lines = [json.dumps({"text": f"doc {i} " + "é中😀\r\n" * (i % 4)}) for i in range(40)]
    raw = ("\n".join(lines[:20]) + "\n\n\r\n" + "\r\n".join(lines[20:])).encode()  # blank lines, CRLF, no last \n
    path = tmp_path / "d.jsonl"
    path.write_bytes(raw)
    whole = list(reader.read_jsonl(path))
    assert len(whole) == 40
    rng = random.Random(0)
    for parts in (1, 2, 3, 5, 40, 200):
        cuts = [0, *sorted(rng.sample(range(1, len(raw) + 5), parts - 1)), len(raw) + 5]
        shares = [list(ranges.read_jsonl(path, cuts[i], cuts[i + 1])) for i in range(parts)]
        assert sum(shares, []) == whole, cuts
    # a range starting exactly at a line's first byte owns that line
    second = raw.index(b"\n") + 1
    assert list(ranges.read_jsonl(path, second, second + 1)) == whole[1:2]


def test_byte_ranges_read_every_parquet_row_group_exactly_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"doc {i} " + "é中😀\r\n" * (i % 4) for i in range(50)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=7)  # 8 groups, the last of 1 row
    assert list(reader.read_parquet(path)) == texts
    size, rng = path.stat().st_size, random.Random(0)
    where_groups_sit = [size * group // 8 for group in range(8)] + [size]  # cuts there, too
    for parts in (1, 2, 3, 8, 50, "at the groups"):
        cuts = where_groups_sit if parts == "at the groups" else [0, *sorted(rng.sample(range(1, size), parts - 1)), size]
        parts = len(cuts) - 1
        shares = [list(ranges.read_parquet(path, cuts[i], cuts[i + 1])) for i in range(parts)]
        assert sum(shares, []) == texts, cuts
        assert all(len(share) % 7 == 0 or texts[-1] in share for share in shares)  # whole groups


def test_offline_corpus_is_the_standard_library_in_sorted_order(monkeypatch, capsys):
    import sysconfig
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    documents, name, _ = reader.open_source("fineweb", data_was_named=False)
    first = min(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in p.parts)
    assert name == "stdlib" and read_first(documents) == first.read_text(encoding="utf-8", errors="replace")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("warning: the Hugging Face Hub is off (HF_HUB_OFFLINE=1)")


def test_the_offline_corpus_is_the_same_text_in_every_reader():
    # The multi-GPU trainer reads the stdlib's files as .txt files (CRLF kept, bad UTF-8 counted as U+FFFD): the
    # others must read the very same text, or the trainers' contract breaks on the default source (it did, from
    # lib2to3's crlf.py on, 7.8M characters in, where universal newlines made "\r\n" "\n").
    import sysconfig
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in sorted(stdlib.rglob("*.py")) if "site-packages" not in path.parts]
    odd = 0
    for path, document in zip(files, reader.stdlib_documents(), strict=True):
        raw = path.read_bytes()
        if b"\r" in raw or raw.decode("utf-8", "replace").encode() != raw:
            assert document == next(ranges.read_txt(path, 10**12)), path
            odd += 1
    assert odd > 0 or not any(b"\r" in path.read_bytes() for path in files)


def read_first(documents):
    return next(iter(documents(10**9)))


# ---------------------------------------------------------------- bad input: one UserError line naming where


BAD_JSONL_LINES = {
    "text is a number": '{"text": 42}',
    "text is null": '{"text": null}',
    "no text field": '{"body": "x"}',
    "a list": '[1, 2]',
    "a bool": 'true',
    "a string": '"just text"',
    "not json": '{"text": "unclosed',
    "nested past the recursion limit": '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}",
}


@pytest.mark.parametrize("case", list(BAD_JSONL_LINES))
def test_bad_jsonl_line_names_file_and_line(tmp_path, case):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + BAD_JSONL_LINES[case] + "\n")
    with pytest.raises(reader.UserError, match=r"bad\.jsonl:3 is not a JSON object with a string \"text\" field"):
        read(path)
    start = len('{"text": "fine"}\n\n')  # read as a byte range, the line is named by its first byte
    with pytest.raises(ranges.UserError, match=f"the line at byte {start}"):
        list(ranges.read_jsonl(path, start - 1, path.stat().st_size))


def test_bad_parquet_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocolumn.parquet")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 2 + b"PAR1")
    expected = {"nulls": """nulls.parquet (ValueError: a row's "text" is None, not a string)""",
                "ints": """ints.parquet (ValueError: a row's "text" is 1, not a string)""",
                "nocolumn": """nocolumn.parquet (ValueError: no "text" column)""",
                "corrupt": "corrupt.parquet (ArrowInvalid: "}
    for name, message in expected.items():
        with pytest.raises(reader.UserError, match=re.escape(message)) as error:
            read(tmp_path / f"{name}.parquet")
        assert "\n" not in str(error.value)


def test_missing_unknown_pipe_and_empty_directory_are_one_message(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "pipe.txt")  # opened, it would wait for a writer forever
    for data in ["no.txt", "notes.md", "pipe.txt", "empty"]:
        with pytest.raises(reader.UserError, match=f"--data .*{data} is none of: a .txt, .jsonl or .parquet file, "
                                                   "a directory of them, fineweb, fineweb-edu"):
            reader.local_files(str(tmp_path / data))  # not read(): a reader that opened the pipe would hang here
    (tmp_path / "empty" / "a.txt").write_text("a")
    os.mkfifo(tmp_path / "empty" / "b.txt")
    assert read(tmp_path / "empty") == ["a"]  # in a directory, a named pipe is skipped


# ---------------------------------------------------------------- the Hub: offline switches and HF_ENDPOINT


@pytest.fixture
def online(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_switches_are_honoured(online, name):
    online.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # were it probed, the message would name it
    online.setenv(name, "1")
    assert reader.hub_problem() == f"the Hugging Face Hub is off ({name}=1)"
    online.setenv(name, "0")
    assert "127.0.0.1:9" in reader.hub_problem()


class CountingHandler(socketserver.BaseRequestHandler):
    connections = 0
    connected = threading.Event()

    def handle(self):
        CountingHandler.connections += 1
        CountingHandler.connected.set()
        if self.request.recv(1024):  # an HTTP request: answer it, a mirror that lacks the file
            self.request.sendall(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")


def test_the_probe_goes_to_the_mirror_in_hf_endpoint(online):
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), CountingHandler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        online.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        CountingHandler.connections = 0
        assert reader.hub_problem() is None
        assert CountingHandler.connected.wait(10)
        server.shutdown()
    assert CountingHandler.connections == 1


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_is_named(online, capsys):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    online.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(reader.UserError, match=f"can't reach the Hugging Face Hub at {endpoint}, needed for --data fineweb"):
        reader.open_source("fineweb", data_was_named=True)
    assert reader.open_source("fineweb", data_was_named=False)[1] == "stdlib"
    assert f"warning: can't reach the Hugging Face Hub at {endpoint}: using the offline corpus" in capsys.readouterr().err


def test_hub_rows_stream_through_datasets_as_from_local_files(tmp_path, corpus):
    # The Hub's path (FineWeb) can't be reached here: the same `datasets` calls (streaming, the rows' "text") read
    # local files of real text instead. train_bpe_multigpu.py's ranks take shares: a file each where the files
    # split evenly, else every other row; together all the documents, once.
    import pyarrow as pa
    import pyarrow.parquet as pq
    with open(corpus("enwiki.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(next(f))["text"] for _ in range(20)]
    one_file, halves = str(tmp_path / "docs.jsonl"), [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    Path(one_file).write_text("".join(json.dumps({"id": i, "text": doc}) + "\n" for i, doc in enumerate(docs)))
    pq.write_table(pa.table({"text": docs[:10]}), halves[0])
    pq.write_table(pa.table({"text": docs[10:]}), halves[1])
    assert list(reader.datasets_texts("docs", path="json", data_files=one_file)) == docs
    assert list(reader.datasets_texts("halves", path="parquet", data_files=halves)) == docs
    shares = [list(ranges.datasets_texts("x", (rank, 2), path="parquet", data_files=halves)) for rank in (0, 1)]
    assert shares == [docs[:10], docs[10:]]
    shares = [list(ranges.datasets_texts("x", (rank, 2), path="json", data_files=one_file)) for rank in (0, 1)]
    assert shares == [docs[::2], docs[1::2]]
    # a row without a string "text", and a file that is not there: one line naming the source
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    for module, node in ((reader, ()), (ranges, ((0, 1),))):
        with pytest.raises(module.UserError, match="can't read bad .ValueError: row 2 has no string .text."):
            list(module.datasets_texts("bad", *node, path="json", data_files=str(tmp_path / "bad.jsonl")))
        with pytest.raises(module.UserError, match="can't read gone .FileNotFoundError: "):
            list(module.datasets_texts("gone", *node, path="json", data_files=str(tmp_path / "gone.jsonl")))


# ---------------------------------------------------------------- through the command line: one line, no traceback


CLI_ERRORS = {  # one command line per kind of reader error: --data, its environment, the error line (CLOSED: a dead port)
    "bad jsonl line": ("bad.jsonl", {}, "bad.jsonl:2 is not a JSON object"),
    "bad parquet row": ("bad.parquet", {},
                        """can't read bad.parquet (ValueError: a row's "text" is 7, not a string)"""),
    "missing path": ("nothing.txt", {}, "--data nothing.txt is none of: a .txt, .jsonl or .parquet file"),
    "named pipe": ("pipe.txt", {}, "--data pipe.txt is none of: a .txt"),  # not a wait for a writer, forever
    "hub unreachable": ("fineweb-edu", {"HF_ENDPOINT": "CLOSED"},
                        "can't reach the Hugging Face Hub at CLOSED, needed for --data fineweb-edu"),
    "hub offline": ("fineweb", {"HF_DATASETS_OFFLINE": "1"},
                    "the Hugging Face Hub is off (HF_DATASETS_OFFLINE=1), needed for --data fineweb"),
}


@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_reader_errors_reach_the_user_as_one_line(tmp_path, case):
    import pyarrow as pa
    import pyarrow.parquet as pq
    data, env_extra, message = CLI_ERRORS[case]
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": 42}\n')
    pq.write_table(pa.table({"text": [7]}), tmp_path / "bad.parquet")
    os.mkfifo(tmp_path / "pipe.txt")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")}
    env.update({k: v.replace("CLOSED", endpoint) for k, v in env_extra.items()})
    result = subprocess.run([sys.executable, str(REPO / "train_bpe_cpu.py"), "--data", data, "-v", "260", "--out", "tok"],
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message.replace("CLOSED", endpoint) in error_lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "tok").exists()
