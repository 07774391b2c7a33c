//! The documentation's links: every Markdown file of the repository (README.md, docs/, deploy/,
//! clients/, …) is parsed, and a relative link whose file does not exist, or whose `#anchor` is
//! not a heading of that file, fails the test with the file and line. External `http(s)` links
//! are not fetched (the tests run without a network); they are only checked to be well-formed.
//!
//! Anchors follow GitHub's rules: the heading's text, lowercased, with punctuation dropped
//! (letters, digits, `-` and `_` kept), each space turned into `-`, and `-1`, `-2`, … appended to
//! repeated headings.
//!
//! The README stays short (at most 400 lines) and links every page of docs/.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Component, Path, PathBuf};

/// Directories never searched for Markdown: build output, dependencies, version control.
const SKIPPED_DIRS: &[&str] = &["target", "build", "node_modules", "dist", "venv"];

/// The repository's root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.md` file under `dir`, skipping hidden directories and [`SKIPPED_DIRS`].
fn markdown_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !name.starts_with('.') && !SKIPPED_DIRS.contains(&name) {
                markdown_files(&path, found);
            }
        } else if name.ends_with(".md") {
            found.push(path);
        }
    }
}

/// The lines of a Markdown text outside fenced code blocks (``` or ~~~), with their numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m => fence = None,
            (None, None) => lines.push((index + 1, line)),
            _ => {}
        }
    }
    lines
}

/// `line` with its inline code spans (`` `…` ``) blanked out, so that code is not read as links.
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else {
            out.push(if in_code { ' ' } else { c });
        }
    }
    out
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    // Links in a heading count by their text only: `[text](url)` becomes `text`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|i| open + i) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|i| close + i) else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown text: one per ATX heading (`#` to `######`), outside code blocks.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = HashSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) {
            continue;
        }
        let rest = &line[hashes..];
        if !(rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t')) {
            continue;
        }
        // A closing run of `#` is not part of the heading.
        let title = rest.trim().trim_end_matches('#').trim_end();
        let base = slug(title);
        let count = seen.entry(base.clone()).or_insert(0);
        anchors.insert(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    anchors
}

/// Every link target of one line: inline links and images `[text](target "title")`, and
/// reference definitions `[label]: target`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[')
        && let Some(close) = trimmed.find(']')
        && trimmed[close + 1..].starts_with(':')
    {
        let target = trimmed[close + 2..].split_whitespace().next().unwrap_or("");
        targets.push(
            target
                .trim_start_matches('<')
                .trim_end_matches('>')
                .to_owned(),
        );
    }
    let mut rest = line.as_str();
    while let Some(start) = rest.find("](") {
        let after = &rest[start + 2..];
        // Balanced parentheses inside the target, as CommonMark allows.
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = i;
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        let inside = after[..end].trim();
        let target = if let Some(stripped) = inside.strip_prefix('<') {
            stripped.split('>').next().unwrap_or("")
        } else {
            // After the target only a quoted title may follow; anything else is part of a
            // malformed target (a space in it), kept whole so that the check reports it.
            match inside.split_once(char::is_whitespace) {
                Some((target, title)) if title.trim_start().starts_with(['"', '\'', '(']) => target,
                Some(_) => inside,
                None => inside,
            }
        };
        targets.push(target.to_owned());
        rest = &after[end.min(after.len())..];
    }
    targets
}

/// Whether an external link is well-formed: `http(s)://host[:port][/…]` with a host name made of
/// letters, digits, `.` and `-`, and nothing that a URL cannot hold unescaped.
fn well_formed_url(url: &str) -> bool {
    let Some(rest) = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
    else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    };
    let host_ok = !host.is_empty()
        && !host.starts_with(['.', '-'])
        && !host.ends_with('-')
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
    let chars_ok = !url
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '<' | '>' | '"' | '\\'));
    host_ok && port_ok && chars_ok
}

/// `path` with `.` and `..` resolved lexically (the file need not exist).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// `%XX` escapes decoded, for a link to a file whose name has a space or the like.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = text.get(i + 1..i + 3)
            && let Ok(byte) = u8::from_str_radix(hex, 16)
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The broken links of one Markdown file, as `file:line: why` messages. `read` gives another
/// file's text (for its anchors); `exists` says whether a path exists.
fn broken_links(
    file: &Path,
    text: &str,
    exists: &dyn Fn(&Path) -> bool,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Vec<String> {
    let mut broken = Vec::new();
    let shown = file.display();
    for (number, line) in prose_lines(text) {
        for target in link_targets(line) {
            let at = format!("{shown}:{number}: `{target}`");
            if target.is_empty() {
                broken.push(format!("{at}: an empty link"));
                continue;
            }
            if target.starts_with("http://") || target.starts_with("https://") {
                if !well_formed_url(&target) {
                    broken.push(format!("{at}: a malformed URL"));
                }
                continue;
            }
            if let Some(address) = target.strip_prefix("mailto:") {
                if !address.contains('@') {
                    broken.push(format!("{at}: a malformed mailto link"));
                }
                continue;
            }
            if target.contains("://") || target.starts_with("//") {
                broken.push(format!("{at}: only http(s) links may leave the repository"));
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let linked = if path.is_empty() {
                file.to_path_buf()
            } else if path.starts_with('/') {
                broken.push(format!(
                    "{at}: an absolute path; link relative to the file instead"
                ));
                continue;
            } else {
                normalize(
                    &file
                        .parent()
                        .unwrap_or(Path::new(""))
                        .join(percent_decoded(path)),
                )
            };
            if !exists(&linked) {
                broken.push(format!("{at}: {} does not exist", linked.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if linked.extension().is_some_and(|e| e == "md") {
                let target_text = read(&linked).unwrap_or_default();
                if !anchors(&target_text).contains(&percent_decoded(anchor)) {
                    broken.push(format!(
                        "{at}: no heading of {} has the anchor #{anchor}",
                        linked.display()
                    ));
                }
            } else if !is_line_anchor(anchor) {
                broken.push(format!(
                    "{at}: #{anchor} in a file that is not Markdown (only #L10 or #L10-L20 there)"
                ));
            }
        }
    }
    broken
}

/// GitHub's line anchors in a source file: `L10` or `L10-L20`.
fn is_line_anchor(anchor: &str) -> bool {
    let line = |s: &str| {
        s.strip_prefix('L')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    match anchor.split_once('-') {
        Some((from, to)) => line(from) && line(to),
        None => line(anchor),
    }
}

#[test]
fn every_relative_link_in_the_markdown_files_reaches_an_existing_file_and_heading() {
    let root = root();
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    let relative = |p: &Path| p.strip_prefix(&root).unwrap_or(p).to_path_buf();
    let names: Vec<PathBuf> = files.iter().map(|f| relative(f)).collect();
    for expected in ["README.md", "docs/api.md", "docs/testing.md"] {
        assert!(
            names.iter().any(|n| n == Path::new(expected)),
            "{expected} was not found among the Markdown files: {names:?}"
        );
    }
    let exists = |p: &Path| root.join(p).exists();
    let read = |p: &Path| fs::read_to_string(root.join(p)).ok();
    let mut broken = Vec::new();
    let mut links = 0;
    for name in &names {
        let text = fs::read_to_string(root.join(name)).expect("a Markdown file is UTF-8");
        links += prose_lines(&text)
            .iter()
            .map(|(_, line)| link_targets(line).len())
            .sum::<usize>();
        broken.extend(broken_links(name, &text, &exists, &read));
    }
    assert!(
        links > 50,
        "only {links} links found: is the parser reading the files?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The README is read in ten minutes; the rest belongs in docs/.
#[test]
fn the_readme_stays_short_and_names_the_docs_pages() {
    let readme = fs::read_to_string(root().join("README.md")).expect("cannot read README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 400,
        "README.md has {lines} lines; move detail into docs/"
    );
    let mut pages = Vec::new();
    for entry in fs::read_dir(root().join("docs")).expect("cannot read docs/") {
        let name = entry.expect("a directory entry").file_name();
        let name = name.to_string_lossy().into_owned();
        if name.ends_with(".md") {
            pages.push(name);
        }
    }
    assert!(!pages.is_empty(), "no pages in docs/");
    let unlinked: Vec<&String> = pages
        .iter()
        .filter(|page| !readme.contains(&format!("](docs/{page})")))
        .collect();
    assert!(
        unlinked.is_empty(),
        "README.md does not link these docs pages: {unlinked:?}"
    );
}

#[test]
fn anchors_follow_githubs_rules() {
    let text = "# Store loss and failover\n\
                ## Acquire: `POST /locks/{key}`\n\
                ### Shared locks: `POST /locks/{key}?mode=shared`\n\
                ## Client commands and `lockbroker run`\n\
                ## Notes\n\
                ## Notes\n\
                ## A [linked](other.md) heading ##\n\
                ```\n\
                # not a heading\n\
                ```\n\
                #hashtag, not a heading\n";
    let found = anchors(text);
    let expected: HashSet<String> = [
        "store-loss-and-failover",
        "acquire-post-lockskey",
        "shared-locks-post-lockskeymodeshared",
        "client-commands-and-lockbroker-run",
        "notes",
        "notes-1",
        "a-linked-heading",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(found, expected);
}

#[test]
fn a_missing_file_a_missing_anchor_and_a_malformed_url_are_each_reported() {
    let page = "# Guide\n\
                [ok](api.md#errors) [ok](../README.md#quick-start) [ok](#guide) [ok](../src/lib.rs#L3)\n\
                [ok](https://docs.rs/utoipa) <https://example.com> [ok](../docs/)\n\
                `[in code](nowhere.md)`\n\
                ```\n\
                [in a block](nowhere.md)\n\
                ```\n\
                [gone](missing.md)\n\
                [no such heading](api.md#nope)\n\
                [no such heading here](#quick-start)\n\
                [bad url](https://exa mple.com) [bad url](http://)\n\
                [ref]: ../README.md#gone\n\
                [source anchor](../src/lib.rs#main)\n";
    let pages: HashMap<PathBuf, &str> = [
        (PathBuf::from("README.md"), "# Top\n## Quick start\n"),
        (PathBuf::from("docs/api.md"), "# HTTP API\n## Errors\n"),
        (PathBuf::from("src/lib.rs"), ""),
        (PathBuf::from("docs/guide.md"), page),
    ]
    .into_iter()
    .collect();
    let exists = |p: &Path| pages.contains_key(p) || p == Path::new("docs");
    let read = |p: &Path| pages.get(p).map(|t| (*t).to_owned());
    let broken = broken_links(Path::new("docs/guide.md"), page, &exists, &read);
    let lines: Vec<&str> = broken
        .iter()
        .map(|b| b.split(": ").nth(1).unwrap_or(""))
        .collect();
    assert_eq!(broken.len(), 7, "{broken:#?}");
    for target in [
        "`missing.md`",
        "`api.md#nope`",
        "`#quick-start`",
        "`https://exa mple.com`",
        "`http://`",
        "`../README.md#gone`",
        "`../src/lib.rs#main`",
    ] {
        assert!(
            lines.contains(&target),
            "{target} not reported: {broken:#?}"
        );
    }
}

/// The code-layout table of docs/how-it-works.md: its rows as (paths of the first column, the
/// backquoted names of the second).
fn layout_rows(text: &str) -> Vec<(Vec<String>, Vec<String>)> {
    let section = text
        .split("\n## Code layout")
        .nth(1)
        .expect("docs/how-it-works.md has a Code layout section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let quoted = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let cells: Vec<&str> = line.split(" | ").collect();
            let rest = cells[1..].join(" | ");
            (quoted(cells[0]), quoted(&rest))
        })
        .collect()
}

/// Whether a backquoted name in the table is a file or directory name (`slot.rs`, `memory/`)
/// rather than a type, a route or a flag.
fn names_a_path(name: &str) -> bool {
    const EXTENSIONS: &[&str] = &[".rs", ".lua", ".sh", ".py", ".java", ".toml", ".md"];
    !name.starts_with('.')
        && !name.contains(' ')
        && (name.ends_with('/') || EXTENSIONS.iter().any(|e| name.ends_with(e)))
}

/// Whether `name` (`slot.rs`, `redis/scripts/`) is a path under `dir`, at any depth.
fn found_under(dir: &Path, name: &str) -> bool {
    if dir.join(name.trim_end_matches('/')).exists() {
        return true;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_dir())
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            !name.starts_with('.') && !SKIPPED_DIRS.contains(&name)
        })
        .any(|path| found_under(&path, name))
}

/// The table of `docs/how-it-works.md` says where the code is: every path in its first column
/// exists, every file or directory its second column names exists under that row's paths, and
/// every top-level module of `src/` and every client under `clients/` has a row.
#[test]
fn the_code_layout_table_names_paths_that_exist_and_every_module_of_src() {
    let root = root();
    let text = fs::read_to_string(root.join("docs/how-it-works.md"))
        .expect("cannot read docs/how-it-works.md");
    let rows = layout_rows(&text);
    assert!(rows.len() > 10, "only {} rows read", rows.len());
    let mut wrong = Vec::new();
    let mut listed = HashSet::new();
    for (paths, names) in &rows {
        for path in paths {
            if !root.join(path).exists() {
                wrong.push(format!("{path} does not exist"));
            }
            listed.insert(path.trim_end_matches('/').to_owned());
        }
        let dirs: Vec<PathBuf> = paths
            .iter()
            .map(|p| root.join(p))
            .map(|p| {
                if p.is_dir() {
                    p
                } else {
                    p.parent().unwrap().into()
                }
            })
            .collect();
        for name in names.iter().filter(|n| names_a_path(n)) {
            if !dirs.iter().any(|dir| found_under(dir, name)) {
                wrong.push(format!("`{name}` is not under {}", paths.join(", ")));
            }
        }
    }
    for parent in ["src", "clients"] {
        for entry in fs::read_dir(root.join(parent)).expect("a directory") {
            let name = entry.expect("a directory entry").file_name();
            let path = format!("{parent}/{}", name.to_string_lossy());
            if !listed.contains(&path) {
                wrong.push(format!("{path} has no row"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/how-it-works.md, Code layout:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_layout_check_tells_file_names_from_other_code() {
    for name in [
        "slot.rs",
        "memory/",
        "scripts/",
        "test.sh",
        "src/lockbroker/",
    ] {
        assert!(names_a_path(name), "{name}");
    }
    for name in [
        "LockKey",
        "Store::leave",
        ".lua",
        "GET …?watch=F",
        "lease_routes!",
    ] {
        assert!(!names_a_path(name), "{name}");
    }
    let rows = layout_rows(
        "# How\n\n## Code layout\n\n| path | what |\n|---|---|\n\
         | `src/a/`, `src/b.rs` | `x.rs` (`T`) |\n\n## Next\n| `src/c/` | no |\n",
    );
    assert_eq!(
        rows,
        [(
            vec!["src/a/".to_owned(), "src/b.rs".to_owned()],
            vec!["x.rs".to_owned(), "T".to_owned()]
        )]
    );
}
