//! Every relative link of README.md and docs/ resolves: the file or folder exists, and a
//! `#anchor` names a heading of the page it points into (GitHub's heading ids). No
//! network: links to other sites are left alone.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files the checker reads: README.md and every page under docs/.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a docs directory").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages
}

/// The page's text outside fenced code blocks and inline code spans.
fn prose(markdown: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Inline code: drop what lies between pairs of backticks.
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                out.push_str(part);
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of the page's inline links, `[text](target)`.
fn link_targets(markdown: &str) -> Vec<String> {
    let text = prose(markdown);
    let mut targets = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let end = rest.find([')', ' ', '\n']).unwrap_or(rest.len());
        targets.push(rest[..end].to_owned());
        rest = &rest[end..];
    }
    targets
}

/// GitHub's id of a heading: lower case, punctuation but `-` and `_` dropped, spaces as
/// `-`; a repeated id gets `-1`, `-2`, ...
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let id: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let mut unique = id.clone();
        let mut n = 0;
        while ids.contains(&unique) {
            n += 1;
            unique = format!("{id}-{n}");
        }
        ids.insert(unique);
    }
    ids
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() { page.clone() } else { page.parent().expect("a folder").join(path) };
            let name = page.strip_prefix(root()).unwrap_or(&page).display().to_string();
            if !file.exists() {
                broken.push(format!("{name}: {target}: no such file"));
                continue;
            }
            if let Some(anchor) = anchor {
                let linked = std::fs::read_to_string(&file).unwrap_or_default();
                if !anchors(&linked).contains(anchor) {
                    broken.push(format!("{name}: {target}: no heading #{anchor}"));
                }
            }
        }
    }
    assert!(checked > 100, "checked only {checked} links: the scan is broken");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_checker_reads_links_and_headings_as_github_does() {
    let page = "# The `[router]` table\n## Circuit breakers, and the queue\n## Tables\n## Tables\n\
                see [a](x.md#y) and `[not](a link)`\n```\n[nor](this)\n```\n";
    assert_eq!(link_targets(page), ["x.md#y"]);
    let ids = anchors(page);
    for id in ["the-router-table", "circuit-breakers-and-the-queue", "tables", "tables-1"] {
        assert!(ids.contains(id), "{id} not in {ids:?}");
    }
}
