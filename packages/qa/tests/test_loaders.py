from __future__ import annotations

import pytest

from megalith.common.errors import DataError
from megalith_qa.ingest import UnsafeNameError, UnsupportedTypeError, load_bytes, sanitize_filename

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
        ("C:\\x\\a b.txt", "a_b.txt"),
        ("报告.txt", "报告.txt"),
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
