"""Digests of every compiled plan's op tables (rank blobs, explain, dag), one line per blob.

    python3 scripts/op_tables.py plans/*.yaml plans/published/*.yaml > before.txt
    ... change the code ...
    python3 scripts/op_tables.py plans/*.yaml plans/published/*.yaml > after.txt
    diff before.txt after.txt   # empty: the op tables are byte-identical

The header may change format (its version then changes too); the blobs must not.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile


def digests(config: str) -> list[str]:
    from planner.compiler import compile_file

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p.rplan")
        compile_file(config, out)
        import msgpack

        from schemas.plan import read_blob, read_header

        lines = []
        with open(out, "rb") as f:
            header, start = read_header(f, out)
            index = header.blobs
            for name in sorted(index):
                data = read_blob(f, header, start, name, out)

                h = hashlib.blake2b(msgpack.packb(data, use_bin_type=True), digest_size=16)
                lines.append(f"{config} {name} {h.hexdigest()}")
        return lines


def main(argv: list[str]) -> int:
    for config in argv:
        for line in digests(config):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
