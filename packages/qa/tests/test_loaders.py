from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from megalith.common.errors import DataError
from megalith_qa.documents import content_hash
from megalith_qa.ingest import UnsafeNameError, UnsupportedTypeError, file_kind, load_bytes, sanitize_filename
from megalith_qa.ingest.loaders import MAX_JSON_DEPTH, MAX_NAME_CHARS

EXPECTED_TEXT = {
    "notes.txt": "zebra migration",
    "guide.md": "kettle boils water",
    "page.html": "Magma rises through the crater.",
    "table.csv": "planet: Saturn; moons: 146",
    "record.json": "telescope.name: Hubble",
    "lines.jsonl": "bird: condor",
    "report.pdf": "glacier retreated forty metres",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_TEXT))
def test_each_supported_type_loads_its_text(name: str, sample_files: dict[str, bytes]) -> None:
    doc = load_bytes(name, sample_files[name])
    assert EXPECTED_TEXT[name] in doc.text
    assert doc.kind == name.rsplit(".", 1)[1]
    assert len(doc.source_hash) == 64


def test_html_drops_script_and_markdown_drops_marks(sample_files: dict[str, bytes]) -> None:
    assert "hidden" not in load_bytes("page.html", sample_files["page.html"]).text
    md = load_bytes("guide.md", sample_files["guide.md"]).text
    assert "#" not in md and "**" not in md


def test_unsupported_type_is_refused() -> None:
    with pytest.raises(UnsupportedTypeError, match="'exe'"):
        load_bytes("tool.exe", b"MZ")


def test_bad_jsonl_names_file_and_line() -> None:
    with pytest.raises(DataError, match=r"bad\.jsonl:3"):
        load_bytes("bad.jsonl", b'{"a": 1}\n\n{"b": \n')


def test_bad_json_names_line_and_column() -> None:
    with pytest.raises(DataError, match=r"bad\.json:2:"):
        load_bytes("bad.json", b'{"a": 1,\n "b": }')


def test_ragged_csv_names_line() -> None:
    with pytest.raises(DataError, match=r"r\.csv:3: expected 2 fields, got 3"):
        load_bytes("r.csv", b"a,b\n1,2\n1,2,3\n")


def test_non_utf8_text_is_a_data_error() -> None:
    with pytest.raises(DataError, match="not UTF-8"):
        load_bytes("x.txt", b"\xff\xfe\xfa")


def test_broken_pdf_is_a_data_error() -> None:
    with pytest.raises(DataError, match="x.pdf"):
        load_bytes("x.pdf", b"%PDF-1.4 garbage")


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("notes.md", "notes.md"),
        ("dir/sub/notes.md", "notes.md"),
        ("C:\\x\\a b.txt", f"a_b-{content_hash('a b.txt')[:8]}.txt"),
        ("报告.txt", "报告.txt"),
        ("r\u00e9sum\u00e9.txt", "r\u00e9sum\u00e9.txt"),
        ("re\u0301sume\u0301.txt", "r\u00e9sum\u00e9.txt"),  # NFD (macOS) names are NFC-normalised
    ],
)
def test_sanitize_keeps_a_bare_name(raw: str, clean: str) -> None:
    assert sanitize_filename(raw) == clean


@pytest.mark.parametrize(
    "raw", ["../../etc/passwd.txt", "a/../../b.md", "..\\secret.txt", "", "...", "noext", "a\x00.txt"]
)
def test_sanitize_refuses_traversal_and_empty(raw: str) -> None:
    with pytest.raises(UnsafeNameError):
        sanitize_filename(raw)


def test_sanitized_names_never_merge() -> None:
    """Names that differ only in replaced characters stay different sources (a hash of the original is added)."""
    raws = ["a b.txt", "a_b.txt", "a?b.txt", "x\U0001f600.txt", "x\U0001f603.txt", "résumé.txt", "rüsumü.txt"]
    clean = [sanitize_filename(r) for r in raws]
    assert len(set(clean)) == len(raws), clean
    assert clean[1] == "a_b.txt"  # an already clean name is kept as it is
    assert re.fullmatch(r"x-[0-9a-f]{8}\.txt", clean[3])


@pytest.mark.parametrize(("raw", "ext"), [("a" * 195 + ".jsonl", "jsonl"), ("b" * 198 + ".txt", "txt")])
def test_long_names_keep_their_extension(raw: str, ext: str) -> None:
    clean = sanitize_filename(raw)
    assert len(clean) <= MAX_NAME_CHARS and clean.endswith("." + ext)
    assert file_kind(clean) == ext
    other = sanitize_filename(raw[: -1 - len(ext)] + "Z." + ext)  # same first 200 characters
    assert other != clean


@pytest.mark.parametrize(
    ("name", "data", "where"),
    [
        ("deep.json", b"[" * 5000 + b"]" * 5000, rf"deep\.json:1:{MAX_JSON_DEPTH + 1}: nested deeper than"),
        ("deep2.json", b"[" * 900 + b"1" + b"]" * 900, rf"deep2\.json:1:{MAX_JSON_DEPTH + 1}: nested deeper"),
        ("deep3.json", b'{"a":\n' + b"[" * 300 + b"]" * 300 + b"}", r"deep3\.json:2:\d+: nested deeper"),
        ("deep.jsonl", b'{"a": 1}\n' + b"[" * 5000 + b"]" * 5000 + b"\n", r"deep\.jsonl:2:\d+: nested"),
        ("big.json", b'{"n": ' + b"1" * 5000 + b"}", r"big\.json:1:7: integer with 5000 digits"),
        (
            "big.jsonl",
            b'{"a": 1}\n{"n": -' + b"7" * 5000 + b"}\n",
            r"big\.jsonl:2:7: integer with 5000 digits",
        ),
        ("big.csv", b"h,i\n1,2\n" + b"x" * 200_000 + b",3\n", r"big\.csv:3: field larger than field limit"),
    ],
)
def test_data_past_parser_limits_is_a_data_error_naming_file_and_line(
    name: str, data: bytes, where: str
) -> None:
    with pytest.raises(DataError, match=where):
        load_bytes(name, data)


def test_json_within_limits_still_loads() -> None:
    nested = load_bytes("ok.json", b"[" * 150 + b'"deep value"' + b"]" * 150).text
    assert nested.endswith(": deep value")
    assert load_bytes("n.json", b'{"n": ' + b"9" * 4000 + b"}").text == "n: " + "9" * 4000
    big_float = load_bytes("f.json", b'{"f": 1.' + b"0" * 5000 + b"}").text  # floats have no digit limit
    assert big_float == "f: 1.0"


def test_self_referencing_pdf_length_is_a_data_error(pdf_factory: Callable[[list[str]], bytes]) -> None:
    """pypdf's LimitReachedError (a /Length that refers to its own object) is a DataError, not a 500."""
    base = pdf_factory(["Glacier report: the glacier retreated forty metres."])
    i = base.index(b"/Length ")
    j = base.index(b">>", i)
    bad = base[:i] + b"/Length 4 0 R".ljust(j - i) + base[j:]
    with pytest.raises(DataError, match=r"selfref\.pdf: not a readable PDF"):
        load_bytes("selfref.pdf", bad)


def test_csv_error_names_the_physical_line() -> None:
    data = b'name,note\na,"line one\nline two\nline three"\nb,c,EXTRA\n'
    with pytest.raises(DataError, match=r"multiline\.csv:5: expected 2 fields, got 3"):
        load_bytes("multiline.csv", data)
    ok = load_bytes("blank.csv", b"a,b\n\n1,2\n\n").text  # blank lines are not rows
    assert ok == "a: 1; b: 2"


def test_jsonl_lines_end_at_newline_only() -> None:
    """U+2028, U+2029 and U+0085 are legal unescaped inside JSON strings; str.splitlines() splits on them."""
    text = "first\u2028second\u2029third\x85end"
    raw = ('{"text": "' + text + '"}\n{"text": "next"}\r\n').encode()
    assert load_bytes("ls.jsonl", raw).text == f"text: {text}\n\ntext: next"
