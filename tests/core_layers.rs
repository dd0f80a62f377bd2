//! No two modules of `src/core/` import each other.
//!
//! A module here is one entry of `src/core/`: a file (`core/paging.rs`) or a directory with
//! its `mod.rs` and submodules (`core/sync/`, everything under it). The test reads every
//! `.rs` file under `src/core/`, drops comments, and collects the core modules each one
//! names:
//!
//! - `crate::core::NAME` (also inside `use crate::core::{a::X, b}` groups), and from a file
//!   directly under `src/core/` also `super::NAME`, from one a level deeper
//!   `super::super::NAME`;
//! - a `NAME` that is no module but an item re-exported by `src/core/mod.rs`
//!   (`crate::core::SyncConfig`) counts as the module it is re-exported from.
//!
//! Test code counts as well: a test in `core/sync/` importing `core/session/` while the
//! session imports the sync machine would be the same circle. If module A names module B
//! and B names A, the test fails and prints both, with the lines that name each other.
//! Deterministic, no network; it cannot see paths spelled through a `use` alias of
//! `crate::core`, which the sources do not use.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .expect("read src/core")
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without `//` comments (doc comments included) and without string literals'
/// contents, so a path quoted in a message or a doc link is not an import.
fn code_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut in_block = 0usize;
    while i < bytes.len() {
        let rest = &text[i..];
        if in_block > 0 {
            if rest.starts_with("*/") {
                in_block -= 1;
                i += 2;
            } else if rest.starts_with("/*") {
                in_block += 1;
                i += 2;
            } else {
                if bytes[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
        } else if rest.starts_with("//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if rest.starts_with("/*") {
            in_block = 1;
            i += 2;
        } else if bytes[i] == b'"' {
            // A plain string literal: skip to its unescaped end.
            out.push('"');
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                if bytes[i] == b'\\' {
                    i += 1;
                } else if bytes[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            out.push('"');
            i += 1;
        } else if rest.starts_with("'\"'") {
            out.push_str("' '");
            i += 3;
        } else {
            let c = rest.chars().next().expect("non-empty");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The first identifier of `s` (after whitespace).
fn ident(s: &str) -> &str {
    let s = s.trim_start();
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The names a path that continues at `rest` starts with: one identifier, or the first
/// identifier of each element of a `{…}` group.
fn first_names(rest: &str) -> Vec<String> {
    let rest = rest.trim_start();
    let Some(group) = rest.strip_prefix('{') else {
        return vec![ident(rest).to_string()];
    };
    let mut names = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                names.push(ident(&group[start..i]).to_string());
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                names.push(ident(&group[start..i]).to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

/// Items `src/core/mod.rs` re-exports, by the module they come from.
fn root_reexports(core_mod: &str) -> BTreeMap<String, String> {
    let code = code_only(core_mod);
    let mut map = BTreeMap::new();
    // `pub use a::{X, Y};` and `pub use a::X;`, possibly over several lines.
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let Some(path) = stmt
            .strip_prefix("pub use ")
            .or_else(|| stmt.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let module = ident(path).to_string();
        let rest = &path[module.len()..];
        let Some(rest) = rest.strip_prefix("::") else {
            continue;
        };
        for name in first_names(rest) {
            map.insert(name, module.clone());
        }
        // A single item: `pub use a::b::X` re-exports the last segment.
        if !rest.trim_start().starts_with('{') {
            if let Some(last) = rest.rsplit("::").next() {
                map.insert(ident(last).to_string(), module.clone());
            }
        }
    }
    map
}

#[test]
fn no_two_core_modules_import_each_other() {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files);

    // The core modules: each entry of src/core/ but mod.rs.
    let mut modules = BTreeSet::new();
    for entry in fs::read_dir(&core).expect("read src/core") {
        let path = entry.expect("dir entry").path();
        let name = path
            .file_stem()
            .expect("name")
            .to_string_lossy()
            .to_string();
        if name != "mod" {
            modules.insert(name);
        }
    }
    let reexports = root_reexports(&fs::read_to_string(core.join("mod.rs")).expect("mod.rs"));

    // (from, to) -> the first line of `from` naming `to`.
    let mut edges: BTreeMap<(String, String), String> = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(&core).expect("under src/core");
        let parts: Vec<_> = rel
            .iter()
            .map(|p| p.to_string_lossy().to_string())
            .collect();
        if parts == ["mod.rs"] {
            continue;
        }
        let module = parts[0].trim_end_matches(".rs").to_string();
        // The spellings that reach src/core/ from this file.
        let mut roots = vec!["crate::core::".to_string()];
        match parts.len() {
            1 => roots.push("super::".to_string()),
            2 => roots.push("super::super::".to_string()),
            _ => {}
        }
        let code = code_only(&fs::read_to_string(file).expect("read source"));
        for (lineno, line) in code.lines().enumerate() {
            for root in &roots {
                let mut from = 0;
                while let Some(at) = line[from..].find(root.as_str()) {
                    let start = from + at;
                    from = start + root.len();
                    // `super::` must not be the tail of `super::super::` or of a longer path.
                    if root == "super::" && line[..start].ends_with("::") {
                        continue;
                    }
                    for name in first_names(&line[from..]) {
                        let target = if modules.contains(&name) {
                            Some(name)
                        } else {
                            reexports.get(&name).cloned()
                        };
                        if let Some(target) = target.filter(|t| *t != module) {
                            edges.entry((module.clone(), target)).or_insert_with(|| {
                                format!("{}:{}: {}", rel.display(), lineno + 1, line.trim())
                            });
                        }
                    }
                }
            }
        }
    }

    let mut circles = Vec::new();
    for ((a, b), line) in &edges {
        if a < b {
            if let Some(back) = edges.get(&(b.clone(), a.clone())) {
                circles.push(format!(
                    "core/{a} and core/{b} import each other:\n    {line}\n    {back}"
                ));
            }
        }
    }
    assert!(
        edges.len() > 10,
        "the scan found only {} imports between core modules: is it still reading src/core/?",
        edges.len()
    );
    assert!(circles.is_empty(), "{}", circles.join("\n"));
}
