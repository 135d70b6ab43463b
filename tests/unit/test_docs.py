"""README.md stays short, and every link in it and in docs/ leads to a file of the repository.

Pure Python, no network: links and images must be relative paths to files that exist inside the
repository, and an #anchor must be the slug of a heading of its target, as GitHub makes it.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target), text over several lines, an optional "title"
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>\s]*)>", re.I)
BARE_URL = re.compile(r"(?<![\w/(<])(?:https?://|www\.)[^\s)>]+", re.I)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")


def markdown_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where links are links."""
    kept, fence = [], None
    for line in text.split("\n"):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            kept.append("")
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            kept.append("")
        else:
            kept.append(line)
    return INLINE_CODE.sub("", "\n".join(kept))


def link_targets(text: str) -> list[str]:
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_DEFINITION.findall(body)


def external_links(text: str) -> list[str]:
    body = prose(text)
    plain = REFERENCE_DEFINITION.sub("", INLINE_LINK.sub("", AUTOLINK.sub("", body)))
    return AUTOLINK.findall(body) + BARE_URL.findall(plain)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text(encoding="utf-8")).split("\n"):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """Every way a link of the markdown file at path fails to lead to a part of the repository."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(root).as_posix()
    problems = [f"{name}: external link {url}" for url in external_links(text)]
    for target in link_targets(text):
        if not target:
            problems.append(f"{name}: empty link target")
            continue
        if SCHEME.match(target) or target.startswith("//"):
            problems.append(f"{name}: external link {target}")
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            problems.append(f"{name}: absolute path {target}")
            continue
        resolved = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{name}: {target} leaves the repository")
            continue
        if not resolved.is_file():
            problems.append(f"{name}: {target} is not a file of the repository")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{name}: {target}: no heading with the anchor #{anchor}")
        elif anchor and resolved.suffix != ".md":
            problems.append(f"{name}: {target}: an anchor into a file that is not markdown")
    return problems


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


def test_docs_pages_exist():
    assert len(markdown_files()) > 1, "no pages under docs/"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_stay_in_the_repository(path):
    assert link_problems(path) == []


def test_slugs_follow_github():
    assert slug("Keys, rate limits and usage") == "keys-rate-limits-and-usage"
    assert slug("The KV cache: multi-turn replay") == "the-kv-cache-multi-turn-replay"
    assert slug("`deepmesh serve` and Tier 0") == "deepmesh-serve-and-tier-0"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Second part\n", encoding="utf-8")
    (tmp_path / "code.py").write_text("", encoding="utf-8")
    good = "[a](docs/a.md) [b](docs/a.md#second-part) [c](#top) ![d](code.py)\n\n# Top\n"
    bad = {
        "[a](docs/missing.md)": "is not a file",
        "[a](docs/a.md#third-part)": "no heading",
        "[a](#nowhere)": "no heading",
        "[a](docs)": "is not a file",
        "[a](../outside.md)": "leaves the repository",
        "[a](/etc/passwd)": "absolute path",
        "[a](https://example.com/x)": "external link",
        "![plot](http://example.com/p.png)": "external link",
        "see <https://example.com>": "external link",
        "see https://example.com/x for more": "external link",
        "[a][ref]\n\n[ref]: https://example.com": "external link",
        "[two\nlines](docs/gone.md)": "is not a file",
    }
    readme = tmp_path / "README.md"
    readme.write_text(good + "`[not a link](nowhere.md)`\n\n```\n[nor this](nowhere.md)\n```\n", encoding="utf-8")
    assert link_problems(readme, tmp_path) == []
    for link, problem in bad.items():
        readme.write_text(good + link + "\n", encoding="utf-8")
        found = link_problems(readme, tmp_path)
        assert len(found) == 1 and problem in found[0], (link, found)
