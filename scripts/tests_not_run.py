"""The collected tests that a junit file has no result for (a test run stopped at its time limit).

    pytest --collect-only -q TESTS | python scripts/tests_not_run.py junit.xml

Reads test ids (path::name[params]) on standard input; prints the count, then each id not in the junit file.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree


def finished(junit_path: str) -> set[str]:
    """Test ids with a result in the junit file (its classname is the dotted path, name the test)."""
    ids = set()
    for case in ElementTree.parse(junit_path).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        ids.add(f"{path}.py::{case.get('name')}")
    return ids


def main(argv: list[str]) -> int:
    done = finished(argv[1])
    collected = [line.strip() for line in sys.stdin if "::" in line]
    missing = [test for test in collected if test not in done]
    print(f"{len(missing)} of {len(collected)} collected tests have no result")
    print("\n".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
