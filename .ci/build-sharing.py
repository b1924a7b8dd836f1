"""What CI's builds compiled, from cargo's --timings reports (the files named on the command line,
in build order): for each build the units it compiled and their CPU time, then the crates that
more than one build compiled (a crate is compiled again when its features, or those of any
crate below it, differ between builds). Prints part of .ci/run's time table; never fails CI."""
import json
import re
import sys
from collections import defaultdict


def compiled_units(path):
    """(name, version, target) -> seconds, for the units this build compiled (fresh ones: 0 s)."""
    text = open(path, encoding="utf-8").read()
    found = re.search(r"const UNIT_DATA = (\[.*?\]);\n", text, re.S)
    if not found:
        return {}
    units = {}
    for unit in json.loads(found.group(1)):
        if unit["duration"] > 0:
            key = (unit["name"], unit["version"], unit["target"].strip())
            units[key] = units.get(key, 0) + unit["duration"]
    return units


def main(paths):
    builds = [compiled_units(path) for path in paths]
    times = defaultdict(list)
    for number, units in enumerate(builds, 1):
        print(f"    build {number}: {len(units)} units compiled, {sum(units.values()):.0f} s of CPU")
        for key, seconds in units.items():
            times[key].append(seconds)
    again = {key: seconds for key, seconds in times.items() if len(seconds) > 1}
    extra = sum(sum(seconds) - max(seconds) for seconds in again.values())
    print(f"    compiled by more than one build: {len(again)} units, {extra:.0f} s of CPU beyond one build each")
    largest = sorted(again.items(), key=lambda item: -sum(item[1]))[:8]
    if largest:
        print("      largest: " + ", ".join(
            f"{name}{' ' + target if target else ''} x{len(seconds)} ({sum(seconds):.0f} s)"
            for (name, _, target), seconds in largest))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception as error:  # a summary, never a reason for CI to fail
        print(f"    (no build summary: {error})")
