"""``rankmesh layout draw`` and :func:`rankmesh.draw.draw_layout` write real PNG and SVG files."""

from __future__ import annotations

import pytest

from rankmesh import LayoutError
from rankmesh.cli import main
from rankmesh.layout import load_layout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cli_draws_a_png(capsys, tmp_path):
    out = tmp_path / "cpu.png"
    code = main(["layout", "draw", "cpu_demo", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip() == f"wrote {out}"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000


def test_draw_layout_writes_an_svg_of_one_role(tmp_path):
    from rankmesh.draw import draw_layout

    out = draw_layout(load_layout("moe_ep"), tmp_path / "moe.svg", roles=["actor"])
    text = out.read_text()
    assert text.startswith("<?xml") and "<svg" in text and text.rstrip().endswith("</svg>")
    assert len(text) > 20_000


def test_draw_explicit_sizes_with_tp_across_nodes(capsys, tmp_path):
    out = tmp_path / "span.png"
    code = main(["layout", "draw", "--tp", "4", "--dp", "3", "--process-on-nodes", "6,6", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_bad_output_suffix_and_unknown_role(capsys, tmp_path):
    code = main(["layout", "draw", "cpu_demo", "-o", str(tmp_path / "x.gif")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "must end in .png, .svg, .pdf" in err
    code = main(["layout", "draw", "cpu_demo", "--role", "judge", "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2 and "unknown role 'judge'" in err
    assert not (tmp_path / "x.png").exists()


def test_draw_layout_refuses_unknown_formats(tmp_path):
    from rankmesh.draw import draw_layout

    with pytest.raises(LayoutError, match="use .png, .svg or .pdf"):
        draw_layout(load_layout("cpu_demo"), tmp_path / "x.jpg")
