"""The performance notes: every heading that the tree cites exists, and the file stays short (CPU only).

Code comments and documents cite a section of docs/perf-notes.md by its heading: the file's name, then a colon or a
comma and the heading ("Ordered grid", or "Section: Subsection"), or a space and quoted headings in parentheses. The
cited name must be the start of a heading of the file (any level), case aside, ending where a word ends: the whole
heading, its beginning, or "Section: Subsection" where Section may drop a trailing parenthesis ("Decode: the loader"
names "### The loader" under "## Decode (decode.cu)").

An unquoted name runs to its first terminator: ')', ';', '"', '`', a comma or full stop followed by a space (or the
end), or the end of its line; a name that a comment wraps onto the next line is read across the break too, and it
is enough that one of the two readings names a heading. docs/history/ (the chronological log, which may name headings
since renamed), the notes themselves, and ignored or hidden folders (build/, .git/, ...) are not scanned.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT / "docs" / "perf-notes.md"
MAX_LINES = 650
SUFFIXES = (".py", ".cu", ".cuh", ".md")
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules"}
SKIP_PATHS = {ROOT / "docs" / "history", NOTES}

# The file's name, then ": " or ", " (the name may be in backticks), or " (" before a quoted name.
CITE = re.compile(r'perf-notes\.md`?(?:[:,][ \t]*|[ \t]+\((?="))')
COMMENT = re.compile(r"\s*(?://+|#+|\*+(?!/)|>)?\s?")
HARD_END = re.compile(r'[);"`]|[,.](?=\s|$)|\.(?=\))')


def headings(text: str) -> list[str]:
    """The names a citation may give a heading of the notes: each heading as written, and each subsection also as
    "Section: Subsection" (Section whole, or without a trailing parenthesis)."""
    names, section, fenced = [], None, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        level, name = len(m[1]), m[2]
        names.append(name)
        if level == 2:
            section = name
        elif level >= 3 and section:
            short = re.sub(r"\s*\([^()]*\)$", "", section)
            names += [f"{section}: {name}", f"{short}: {name}"]
    return names


def _continuation(lines: list[str], i: int, start: int, count: int = 3) -> list[str]:
    """The rest of line i from `start`, then up to `count` more lines without their comment markers."""
    out = [lines[i][start:]]
    for line in lines[i + 1:i + 1 + count]:
        out.append(line[COMMENT.match(line).end():])
    return out


def _names(parts: list[str]) -> list[list[str]]:
    """The names one citation gives (each a list of readings), from the text after the file's name."""
    text = "\n".join(parts).lstrip()
    if text.startswith('"'):
        flat = " ".join(text.split())
        names = []
        for m in re.finditer(r'"([^"]+)"', flat):
            names.append([m[1]])
            if not re.match(r'\s*(?:,|and)\s*"', flat[m.end():]):
                break
        return names
    end = HARD_END.search(text)
    hard = text[:end.start()] if end else text
    readings = [" ".join(hard.split())]
    if "\n" in hard:
        readings.append(" ".join(hard.split("\n", 1)[0].split()))
    return [readings]


def citations(path: Path, text: str) -> list[tuple[str, int, list[str]]]:
    """(where, line, readings) of every name that `text` cites in the notes."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        for m in CITE.finditer(line):
            for readings in _names(_continuation(lines, i, m.end())):
                found.append((str(path), i + 1, readings))
    return found


def names_heading(name: str, names: list[str]) -> bool:
    """Whether `name` is the start of one of the headings' names, ending where a word ends."""
    cited = name.strip().lower()
    if not cited:
        return False
    for heading in names:
        full = " ".join(heading.split()).lower()
        if full.startswith(cited) and (len(full) == len(cited) or not (full[len(cited)].isalnum()
                                                                        or full[len(cited)] == "_")):
            return True
    return False


def unresolved(found, names: list[str]) -> list[str]:
    return [f"{where}:{line}: {readings[0]!r}" for where, line, readings in found
            if not any(names_heading(r, names) for r in readings)]


def scanned_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                             and not d.endswith(".egg-info") and here / d not in SKIP_PATHS)
        for name in sorted(filenames):
            path = here / name
            if name.endswith(SUFFIXES) and path not in SKIP_PATHS:
                yield path


def tree_citations():
    found = []
    for path in scanned_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += citations(path.relative_to(ROOT), text)
    return found


def test_every_cited_heading_exists():
    found = tree_citations()
    assert len(found) >= 20, f"expected the tree to cite the notes; found {len(found)} citations"
    missing = unresolved(found, headings(NOTES.read_text(encoding="utf-8")))
    assert not missing, "cited headings missing from the notes:\n" + "\n".join(missing)


def test_notes_stay_short():
    lines = len(NOTES.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"docs/perf-notes.md has {lines} lines, at most {MAX_LINES}"


def test_matcher_reports_what_names_no_heading():
    names = headings(NOTES.read_text(encoding="utf-8"))
    name = "perf-notes" + ".md"  # (split, so that this file cites nothing itself)
    text = "\n".join([
        f"// a comment (docs/{name}: No such heading). More.",
        f"# docs/{name}, Ordered grid)",
        f'// see docs/{name} ("Peers", "Not a heading either")',
        f"x = 1  # docs/{name}: Backward: fused",
        "#   wgmma) wrapped",
        f"// docs/{name}, Decode: splits).",
    ])
    bad = unresolved(citations(Path("fake.cu"), text), names)
    assert bad == ["fake.cu:1: 'No such heading'", "fake.cu:3: 'Not a heading either'"], bad

    # Removing a heading that the tree cites makes its citations fail.
    notes = NOTES.read_text(encoding="utf-8")
    assert "\n### Ordered grid\n" in notes
    fewer = headings(notes.replace("\n### Ordered grid\n", "\n### Something else\n"))
    gone = unresolved([c for c in tree_citations() if c[2][0].startswith("Ordered grid")], fewer)
    assert gone, "citations of a removed heading were not reported"
