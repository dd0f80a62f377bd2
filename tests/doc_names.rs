//! Every code name the documentation cites still exists.
//!
//! Reads `README.md` and every `docs/**/*.md`, takes each code span in single backticks and
//! checks those that look like a citation of this crate's code:
//!
//! - a source path (`src/core/paging.rs`, `core/paging.rs`, `tests/faults.rs`, `core/sync/`,
//!   a bare `daily.rs`): the file or directory exists, relative to the repository root, to
//!   `src/`, to `docs/` or to the Markdown file, or (a bare file name) anywhere in the sources;
//! - a Rust path (`core::sync::SyncMachine`, `SyncMachine::handle_timeout`) or a call
//!   (`plan_pages()`, `Time::rebased(now)`): every segment is defined somewhere in the `.rs`
//!   files of `src/`, `tests/`, `examples/` and `fuzz/` (`fn`, `struct`, `enum`, `trait`,
//!   `type`, `const`, `static`, `mod`, `macro_rules!`, a `use … as` name, or an enum variant
//!   or struct field starting a line).
//!
//! - a test's name (`a_fetch_that_ends_without_events_it_asked_for_asks_again_and_gets_them`):
//!   a plain identifier in snake case of six words or more, not ending like a metric; it is
//!   defined somewhere (decision records cite the tests that prove them).
//!
//! Other plain identifiers (`SyncMachine`, `events_invalid`), URLs, flags, JSON, shell
//! commands and names of other crates (`EXTERNAL`) are not checked. Deterministic, no network.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// First path segments that name another crate, a primitive or a std type: not checked.
const EXTERNAL: &[&str] = &[
    // crates
    "std",
    "alloc",
    "tungstenite",
    "nostr",
    "nostr_sdk",
    "nostr_relay_builder",
    "negentropy",
    "serde",
    "serde_json",
    "crossbeam_channel",
    "crossbeam",
    "parking_lot",
    "rustls",
    "webpki_roots",
    "rustls_native_certs",
    "rand",
    "log",
    "env_logger",
    "argh",
    "signal_hook",
    "bitcoin_hashes",
    "secp256k1",
    "rcgen",
    "proptest",
    "libc",
    "mio",
    "tokio",
    "glibc",
    // primitives and std types
    "u8",
    "u16",
    "u32",
    "u64",
    "u128",
    "usize",
    "i8",
    "i16",
    "i32",
    "i64",
    "i128",
    "isize",
    "f32",
    "f64",
    "bool",
    "char",
    "str",
    "String",
    "Vec",
    "VecDeque",
    "Box",
    "Arc",
    "Rc",
    "Option",
    "Result",
    "HashMap",
    "HashSet",
    "BTreeMap",
    "BTreeSet",
    "Mutex",
    "RwLock",
    "Instant",
    "SystemTime",
    "Duration",
    "Ordering",
    "thread",
    "io",
    "fs",
    "mem",
    "ptr",
    // types of nostr, tungstenite and negentropy the docs name without their crate
    "Event",
    "EventId",
    "Filter",
    "ClientMessage",
    "RelayMessage",
    "TagKind",
    "Timestamp",
    "Keys",
    "PublicKey",
    "Tag",
    "Kind",
    "RawValue",
    "Value",
    "FrameCodec",
    "WebSocket",
    "Negentropy",
    "NegentropyStorageVector",
    // crossbeam-channel's functions, cited with their arguments
    "bounded",
    "unbounded",
    "send_timeout",
    // the design document's names, mapped to ours in docs/architecture.md
    "SyncManager",
    "SelfSubscriber",
    "RelayConnection",
];

/// Files the docs name that are not this repository's: other projects' sources (nostr-rs-relay's
/// `src/server.rs`, ngit-grasp's `src/sync/mod.rs`), an operator's config, directories
/// cargo-fuzz creates.
const OTHER_FILES: &[&str] = &[
    "config.toml",
    "src/server.rs",
    "src/conn.rs",
    "src/repo/sqlite.rs",
    // ngit-grasp 3.0.10's, cited by decisions 0097–0100
    "src/sync",
    "src/sync/mod.rs",
    "src/sync/filters.rs",
    "src/sync/self_subscriber.rs",
    "src/nostr/builder.rs",
    "src/nostr/events.rs",
    "src/nostr/policy/related.rs",
    "src/nostr/lifecycle/deletion/policy.rs",
    "docs/explanation/decisions.md",
    "fuzz/target",
    "fuzz/corpus",
    "fuzz/artifacts",
];

/// A citation that failed: where, what, and which part is missing.
#[derive(Debug, PartialEq)]
struct Missing {
    file: String,
    line: usize,
    span: String,
    what: String,
}

#[test]
fn every_code_name_the_docs_cite_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let defined = defined_names(root);
    assert!(
        defined.contains("SyncMachine") && defined.contains("handle_timeout"),
        "the definition scan found too little ({} names)",
        defined.len()
    );
    let mut docs = vec![root.join("README.md")];
    markdown_files(&root.join("docs"), &mut docs);
    docs.sort();
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = fs::read_to_string(doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
        let name = doc.strip_prefix(root).unwrap_or(doc).display().to_string();
        let (n, m) = check_text(root, doc.parent().unwrap_or(root), &name, &text, &defined);
        checked += n;
        missing.extend(m);
    }
    assert!(
        checked > 100,
        "only {checked} citations found: is the extraction broken?"
    );
    if !missing.is_empty() {
        let lines: Vec<String> = missing
            .iter()
            .map(|m| format!("{}:{}: `{}`: {}", m.file, m.line, m.span, m.what))
            .collect();
        panic!(
            "{} citation(s) in the docs name code that does not exist:\n{}",
            missing.len(),
            lines.join("\n")
        );
    }
}

/// The check itself reports a name that does not exist, and accepts one that does.
#[test]
fn a_missing_name_is_reported_with_its_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let defined = defined_names(root);
    let text = "Intro.\n\n```sh\n`core::nope::Missing` in a fence\n```\n\
                See `core::nope::Missing` and `SyncMachine::handle_timeout`,\n\
                `src/core/nope.rs`, `core/paging.rs`, `nope_fn()`, `--flag`, `ws://x/a.rs`.\n\
                Tests: `a_test_that_was_renamed_long_ago_and_is_gone`,\n\
                `a_missing_name_is_reported_with_its_line`, `forward_set_aside_total`.\n";
    let (checked, missing) = check_text(root, root, "x.md", text, &defined);
    assert_eq!(checked, 7);
    let found: Vec<(usize, &str)> = missing.iter().map(|m| (m.line, m.span.as_str())).collect();
    assert_eq!(
        found,
        vec![
            (6, "core::nope::Missing"),
            (7, "src/core/nope.rs"),
            (7, "nope_fn()"),
            (8, "a_test_that_was_renamed_long_ago_and_is_gone")
        ]
    );
}

/// Every relative link between the docs reaches a file, and its `#anchor` a heading there.
#[test]
fn every_local_link_in_the_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![root.join("README.md")];
    markdown_files(&root.join("docs"), &mut docs);
    docs.sort();
    let mut broken = Vec::new();
    for doc in &docs {
        let text = fs::read_to_string(doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
        let name = doc.strip_prefix(root).unwrap_or(doc).display().to_string();
        let dir = doc.parent().unwrap_or(root);
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                doc.clone()
            } else {
                dir.join(path)
            };
            let what = if !file.exists() {
                "no such file"
            } else if !anchor.is_empty()
                && file.extension().is_some_and(|e| e == "md")
                && !anchors(&fs::read_to_string(&file).unwrap_or_default()).contains(anchor)
            {
                "no such heading"
            } else {
                continue;
            };
            broken.push(format!("{name}:{line}: ({target}): {what}"));
        }
    }
    assert!(
        broken.is_empty(),
        "{} broken link(s):\n{}",
        broken.len(),
        broken.join("\n")
    );
}

/// `(line, target)` of every inline link `[text](target)` outside fenced code blocks.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = &after[..end];
            if !target.is_empty() && !target.contains(char::is_whitespace) {
                out.push((n + 1, target.to_string()));
            }
            rest = &after[end..];
        }
    }
    out
}

/// The anchors GitHub gives the headings of a Markdown text.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if fenced || !t.starts_with('#') {
            continue;
        }
        let heading = t.trim_start_matches('#').trim();
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut unique = slug.clone();
        let mut k = 1;
        while out.contains(&unique) {
            unique = format!("{slug}-{k}");
            k += 1;
        }
        out.insert(unique);
    }
    out
}

/// What one Markdown text cites: the number of citations checked, and those that failed.
fn check_text(
    root: &Path,
    dir: &Path,
    file: &str,
    text: &str,
    defined: &BTreeSet<String>,
) -> (usize, Vec<Missing>) {
    let mut checked = 0;
    let mut missing = Vec::new();
    for (line, span) in code_spans(text) {
        let what = match classify(&span) {
            None => continue,
            Some(Citation::File(path)) => {
                checked += 1;
                if file_exists(root, dir, &path) {
                    continue;
                }
                "no such file or directory".to_string()
            }
            Some(Citation::Path(segments)) => {
                checked += 1;
                let absent: Vec<&str> = segments
                    .iter()
                    .filter(|s| !defined.contains(s.as_str()))
                    .map(String::as_str)
                    .collect();
                if absent.is_empty() {
                    continue;
                }
                format!("not defined anywhere: {}", absent.join(", "))
            }
        };
        missing.push(Missing {
            file: file.to_string(),
            line,
            span,
            what,
        });
    }
    (checked, missing)
}

enum Citation {
    File(String),
    Path(Vec<String>),
}

/// The directories a source path may be relative to.
const SOURCE_ROOTS: &[&str] = &[
    "src", "tests", "examples", "docs", "fuzz", "core", "engine", "net", "ops", "testing",
];

fn classify(span: &str) -> Option<Citation> {
    let s = span.trim();
    if s.is_empty() || s.contains("://") || s.contains(char::is_whitespace) && !s.ends_with(')') {
        return None;
    }
    if s.starts_with(['-', '/', '#', '$', '.', '~']) {
        return None;
    }
    let path_chars = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    if s.chars().all(path_chars) && s.contains('.') || s.contains('/') {
        if !s.chars().all(path_chars) {
            return None;
        }
        let is_source = [".rs", ".md", ".toml"].iter().any(|ext| s.ends_with(ext));
        let first = s.split('/').next().unwrap_or("");
        let under_root = s.contains('/') && SOURCE_ROOTS.contains(&first);
        if OTHER_FILES.contains(&s) {
            return None;
        }
        return (is_source || under_root).then(|| Citation::File(s.to_string()));
    }
    // A call: `name()`, `Type::name(args)`; the arguments are not looked at.
    let (path, call) = match s.find('(') {
        Some(open) if s.ends_with(')') => (&s[..open], true),
        Some(_) => return None,
        None => (s, false),
    };
    let segments: Vec<&str> = path.split("::").collect();
    let ident = |x: &str| {
        x.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && x.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if segments.len() == 1 && !call && looks_like_test_name(segments[0]) {
        return Some(Citation::Path(vec![segments[0].to_string()]));
    }
    if !segments.iter().all(|x| ident(x)) || segments.len() == 1 && !call {
        return None;
    }
    let mut segments: Vec<String> = segments.iter().map(|x| x.to_string()).collect();
    while segments.len() > 1 && ["grasp_sync", "crate", "self", "super"].contains(&&*segments[0]) {
        segments.remove(0);
    }
    if EXTERNAL.contains(&segments[0].as_str()) {
        return None;
    }
    Some(Citation::Path(segments))
}

/// A plain identifier that reads as a test's name (a sentence in snake case: lower case, six
/// words or more, not a metric or a setting): decision records and docs cite tests by name,
/// so these are checked like paths.
fn looks_like_test_name(s: &str) -> bool {
    let words = s.split('_').count();
    words >= 6
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !s.starts_with('_')
        && !s.contains("__")
        && !["_total", "_seconds", "_bytes", "_ms"]
            .iter()
            .any(|end| s.ends_with(end))
}

fn file_exists(root: &Path, dir: &Path, path: &str) -> bool {
    let path = path.trim_end_matches('/');
    if [
        root.to_path_buf(),
        root.join("src"),
        root.join("docs"),
        dir.to_path_buf(),
    ]
    .iter()
    .any(|base| base.join(path).exists())
    {
        return true;
    }
    // A bare file name: anywhere in the sources.
    !path.contains('/') && {
        let mut files = Vec::new();
        for d in ["src", "tests", "examples", "fuzz"] {
            rust_files(&root.join(d), &mut files);
        }
        files
            .iter()
            .any(|f| f.file_name().is_some_and(|n| n == path))
    }
}

/// `(line, content)` of every single-backtick code span outside fenced code blocks.
fn code_spans(text: &str) -> Vec<(usize, String)> {
    // Fenced blocks become empty lines, so that line numbers stay right.
    let mut fenced = false;
    let prose: Vec<&str> = text
        .lines()
        .map(|line| {
            let t = line.trim_start();
            if t.starts_with("```") || t.starts_with("~~~") {
                fenced = !fenced;
                ""
            } else if fenced {
                ""
            } else {
                line
            }
        })
        .collect();
    let prose = prose.join("\n");
    let bytes = prose.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
        // The closing run of exactly the same length.
        let mut j = i + run;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let r = bytes[j..].iter().take_while(|&&b| b == b'`').count();
                if r == run {
                    close = Some(j);
                    break;
                }
                j += r;
            } else {
                j += 1;
            }
        }
        let Some(close) = close else {
            i += run;
            continue;
        };
        if run == 1 {
            let line = 1 + bytes[..i].iter().filter(|&&b| b == b'\n').count();
            spans.push((line, prose[i + 1..close].to_string()));
        }
        i = close + run;
    }
    spans
}

/// Every name the `.rs` files of the repository define.
fn defined_names(root: &Path) -> BTreeSet<String> {
    let mut files = Vec::new();
    for d in ["src", "tests", "examples", "fuzz"] {
        rust_files(&root.join(d), &mut files);
    }
    let mut names = BTreeSet::new();
    for f in files {
        let text = fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for line in text.lines() {
            let code = strip_comment(line);
            scan_items(code, &mut names);
            if let Some(name) = leading_member(code) {
                names.insert(name.to_string());
            }
        }
        if let Some(stem) = f.file_stem().and_then(|s| s.to_str()) {
            // A file is a module (`mod name;` may be generated, as in `#[path]`).
            names.insert(stem.to_string());
        }
    }
    names
}

/// `fn NAME`, `struct NAME`, … and `use … as NAME` anywhere in a line.
fn scan_items(code: &str, names: &mut BTreeSet<String>) {
    const KEYWORDS: &[&str] = &[
        "fn",
        "struct",
        "enum",
        "trait",
        "type",
        "const",
        "static",
        "mod",
        "union",
        "macro_rules!",
    ];
    let words = words(code);
    for pair in words.windows(2) {
        let name = pair[1];
        let is_ident = name
            .chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_');
        if !is_ident {
            continue;
        }
        if KEYWORDS.contains(&pair[0]) || pair[0] == "as" && code.trim_start().contains("use ") {
            names.insert(name.trim_start_matches("r#").to_string());
        }
    }
}

/// The tokens of a line: identifiers (with a trailing `!` for `macro_rules!`) and single
/// punctuation characters.
fn words(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in code.char_indices() {
        let word = c.is_alphanumeric() || c == '_' || c == '#' && start.is_some();
        match (start, word) {
            (None, true) => start = Some(i),
            (Some(s), false) => {
                let end = if c == '!' { i + 1 } else { i };
                out.push(&code[s..end]);
                start = None;
                if !c.is_whitespace() && c != '!' {
                    out.push(&code[i..i + c.len_utf8()]);
                }
            }
            (None, false) if !c.is_whitespace() => out.push(&code[i..i + c.len_utf8()]),
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push(&code[s..]);
    }
    out
}

/// An enum variant or struct field that starts a line: `NAME:`, `NAME,`, `NAME(`, `NAME {`,
/// `NAME =` or `NAME` alone, after an optional `pub`/`pub(…)`.
fn leading_member(code: &str) -> Option<&str> {
    let mut t = code.trim_start();
    if let Some(rest) = t.strip_prefix("pub") {
        let rest = rest.trim_start();
        t = match rest.strip_prefix('(') {
            Some(r) => r.split_once(')').map(|(_, after)| after.trim_start())?,
            None => rest,
        };
    }
    let end = t
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(t.len());
    let (name, rest) = t.split_at(end);
    if name.is_empty()
        || !name
            .chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
    {
        return None;
    }
    let rest = rest.trim_start();
    let member = rest.is_empty()
        || rest.starts_with(':') && !rest.starts_with("::")
        || rest.starts_with(',')
        || rest.starts_with('(')
        || rest.starts_with('{')
        || rest.starts_with('=') && !rest.starts_with("==");
    member.then_some(name)
}

/// A line without its `//` comment (doc comments cite names; they define none).
fn strip_comment(line: &str) -> &str {
    let mut in_str = false;
    let bytes = line.as_bytes();
    for i in 0..bytes.len() {
        match bytes[i] {
            b'"' if i == 0 || bytes[i - 1] != b'\\' => in_str = !in_str,
            b'/' if !in_str && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
    }
    line
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    walk(dir, out, "rs");
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    walk(dir, out, "md");
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>, ext: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            walk(&path, out, ext);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}
