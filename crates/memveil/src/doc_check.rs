//! The docs agree with the code (issue 35): every `memveil …` command line in
//! README.md, ARCHITECTURE.md, SECURITY.md, BENCHMARKS.md and docs/*.md names
//! subcommands and long options the parser has (canonical names or visible
//! aliases: an old spelling kept as a hidden alias is not for the docs), and
//! every relative link, anchor and `FILE.md, "Section"` reference points at
//! something that exists.
//!
//! What counts as a command line: in fenced code blocks, every `memveil `
//! (after a line start, a blank, `/`, `(`, `|`, `;`, `&` or `$(`), up to a
//! pipe, `&&`, `;`, a redirection or a comment, with `\` continuations
//! joined; in prose, the same inside backtick code spans. Placeholders
//! (`FILE`, `…`, `[--x]`) are fine; a word where the command expects a
//! subcommand must be one; a `--flag` must exist on the command or an
//! ancestor's global options; after `--`, or after the program of
//! `memveil run`, the words are the program's.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use clap::CommandFactory as _;

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Markdown files the checks read, relative to the root.
fn markdown_files() -> Vec<PathBuf> {
    let root = repo();
    let mut v: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "SECURITY.md",
        "BENCHMARKS.md",
    ]
    .iter()
    .map(PathBuf::from)
    .filter(|p| root.join(p).is_file())
    .collect();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "md"))
                .filter_map(|p| p.strip_prefix(&root).ok().map(Path::to_path_buf))
                .collect()
        })
        .unwrap_or_default();
    docs.sort();
    v.extend(docs);
    v
}

/// Lines of `text` with whether each is inside a fenced code block (the
/// fences themselves are left out); `\` continuations inside blocks joined.
fn lines(text: &str) -> Vec<(usize, bool, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, l) in text.lines().enumerate() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            let (n, mut acc) = pending.take().unwrap_or((i + 1, String::new()));
            let body = strip_comment(l);
            if let Some(head) = body.trim_end().strip_suffix('\\') {
                acc.push_str(head);
                acc.push(' ');
                pending = Some((n, acc));
            } else {
                acc.push_str(&body);
                out.push((n, true, acc));
            }
        } else {
            out.push((i + 1, false, l.to_owned()));
        }
    }
    if let Some((n, acc)) = pending {
        out.push((n, true, acc));
    }
    out
}

/// A shell line without its comment (a `#` at a word's start).
fn strip_comment(l: &str) -> String {
    let mut prev = ' ';
    for (i, c) in l.char_indices() {
        if c == '#' && prev.is_whitespace() {
            return l[..i].to_owned();
        }
        prev = c;
    }
    l.to_owned()
}

/// The backtick code spans of a prose paragraph (its lines joined: a span
/// may wrap).
fn code_spans(para: &str) -> Vec<String> {
    para.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect()
}

/// Every `memveil …` command in `text`, as its words after `memveil`.
fn commands(text: &str) -> Vec<Vec<String>> {
    let text = text.replace("\\|", "/").replace("$(", " ( ");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("memveil ") {
        let start = from + at;
        from = start + "memveil ".len();
        let before = text[..start].chars().next_back().unwrap_or(' ');
        if !(before.is_whitespace() || "/(|;&".contains(before)) {
            continue;
        }
        // `cargo test -p memveil --test x`: a package name, not a command.
        if text[..start]
            .split_whitespace()
            .next_back()
            .is_some_and(|w| w.starts_with('-'))
        {
            continue;
        }
        let rest = &text[from..];
        let end = rest
            .find(|c: char| "|;><)`".contains(c))
            .into_iter()
            .chain(rest.find("&&"))
            .chain(rest.find(" &"))
            .min()
            .unwrap_or(rest.len());
        out.push(
            rest[..end]
                .split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>(),
        );
    }
    out
}

/// A word that names a subcommand or a plain value (not a placeholder).
fn plain(w: &str) -> bool {
    w.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && w.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// The long options `cmd` takes (after `build`: globals included), with
/// whether each takes a value.
fn longs(cmd: &clap::Command) -> HashMap<String, bool> {
    let mut m = HashMap::new();
    for a in cmd.get_arguments() {
        let takes = a.get_action().takes_values();
        for l in a.get_long_and_visible_aliases().into_iter().flatten() {
            m.insert(l.to_owned(), takes);
        }
    }
    m
}

/// What is wrong with `memveil WORDS` against `root`, if anything.
fn check_command(root: &clap::Command, words: &[String]) -> Option<String> {
    let mut cmd = root;
    let mut path = String::from("memveil");
    let mut i = 0;
    let mut positionals = 0;
    while i < words.len() {
        let w = words[i].trim_start_matches(['[', '(', '{']);
        i += 1;
        if w == "--" {
            return None;
        }
        if w.ends_with(':') {
            return None; // output, not a command ("memveil run: …")
        }
        if let Some(flag) = w.strip_prefix("--") {
            let name: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            if name.is_empty() || name.ends_with('-') || flag.starts_with('…') {
                continue; // `--…`, `--max-…`: a family named in prose
            }
            match longs(cmd).get(&name) {
                None => return Some(format!("`{path}` has no option --{name}")),
                Some(true) if !flag.contains('=') => i += 1,
                Some(_) => {}
            }
            continue;
        }
        if w.starts_with('-') {
            continue;
        }
        let sub = cmd
            .get_subcommands()
            .find(|s| s.get_name() == w || s.get_all_aliases().any(|a| a == w));
        match sub {
            Some(s) if positionals == 0 => {
                path.push(' ');
                path.push_str(s.get_name());
                cmd = s;
            }
            _ if plain(w)
                && positionals == 0
                && cmd.has_subcommands()
                && cmd.get_positionals().next().is_none() =>
            {
                return Some(format!("`{path}` has no subcommand {w}"));
            }
            _ => {
                positionals += 1;
                if cmd
                    .get_positionals()
                    .any(clap::Arg::is_trailing_var_arg_set)
                {
                    return None; // the program's own words follow
                }
            }
        }
    }
    None
}

/// GitHub's anchors for the headings of a Markdown text.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for (_, fenced, l) in lines(text) {
        if fenced || !l.starts_with('#') {
            continue;
        }
        let title = l.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

/// The sections of a Markdown text, without `#`s and backticks: its
/// headings and its run-in titles (a paragraph or item opening with
/// `**Title.**`, as the docs name the parts of a long section).
fn headings(text: &str) -> Vec<String> {
    lines(text)
        .into_iter()
        .filter(|(_, fenced, _)| !fenced)
        .filter_map(|(_, _, l)| {
            if l.starts_with('#') {
                return Some(l.trim_start_matches('#').trim().replace('`', ""));
            }
            let body = l.trim_start().trim_start_matches("- ").strip_prefix("**")?;
            Some(body[..body.find("**")?].replace('`', ""))
        })
        .collect()
}

/// `[text](target)` links of a prose line (code spans left out).
fn links(l: &str) -> Vec<String> {
    let prose: String = l
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 0)
        .map(|(_, s)| s)
        .collect::<Vec<_>>()
        .join(" ");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = prose[from..].find("](") {
        let s = from + at + 2;
        from = s;
        if let Some(end) = prose[s..].find(')') {
            out.push(prose[s..s + end].trim().to_owned());
        }
    }
    out
}

/// `FILE.md, "Section"` references of a line: (file, section).
fn section_refs(l: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = l[from..].find(".md") {
        let end = from + at + 3;
        from = end;
        let start = l[..end]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || "._/-".contains(c)))
            .map_or(0, |i| i + 1);
        let rest = l[end..].trim_start_matches(',').trim_start();
        if let Some(q) = rest.strip_prefix('"') {
            if let Some(close) = q.find('"') {
                out.push((l[start..end].to_owned(), q[..close].to_owned()));
            }
        }
    }
    out
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The problems of the docs under `root`, against the command line `cli`.
fn problems(root: &Path, files: &[PathBuf], cli: &clap::Command) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut n_cmds = 0;
    for f in files {
        let text = read(&root.join(f));
        let dir = root
            .join(f)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        // Prose paragraphs, whole: (first line, text).
        let mut para: Option<(usize, String)> = None;
        let mut segments: Vec<(usize, String)> = Vec::new();
        for (n, fenced, l) in lines(&text) {
            if fenced || l.trim().is_empty() {
                if let Some((m, p)) = para.take() {
                    segments.extend(code_spans(&p).into_iter().map(|s| (m, s)));
                }
                if fenced {
                    segments.push((n, l));
                }
            } else {
                let p = para.get_or_insert((n, String::new()));
                p.1.push(' ');
                p.1.push_str(&l);
            }
        }
        if let Some((m, p)) = para.take() {
            segments.extend(code_spans(&p).into_iter().map(|s| (m, s)));
        }
        for (n, seg) in segments {
            for words in commands(&seg) {
                n_cmds += 1;
                if let Some(e) = check_command(cli, &words) {
                    wrong.push(format!(
                        "{}:{n}: memveil {}: {e}",
                        f.display(),
                        words.join(" ")
                    ));
                }
            }
        }
        for (n, fenced, l) in lines(&text) {
            let at = format!("{}:{n}", f.display());
            if fenced {
                continue;
            }
            for target in links(&l) {
                if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                    continue;
                }
                let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let file = if path.is_empty() {
                    root.join(f)
                } else {
                    dir.join(path)
                };
                if !file.exists() {
                    wrong.push(format!("{at}: link to {target}: {} does not exist", path));
                    continue;
                }
                if !anchor.is_empty() && !anchors(&read(&file)).contains(anchor) {
                    wrong.push(format!(
                        "{at}: link to {target}: no heading #{anchor} there"
                    ));
                }
            }
            for (file, section) in section_refs(&l) {
                let p = [dir.join(&file), root.join(&file)]
                    .into_iter()
                    .find(|p| p.is_file());
                let Some(p) = p else {
                    wrong.push(format!(
                        "{at}: {file}, \"{section}\": {file} does not exist"
                    ));
                    continue;
                };
                let want = section.to_lowercase();
                if !headings(&read(&p))
                    .iter()
                    .any(|h| h.to_lowercase().starts_with(&want))
                {
                    wrong.push(format!("{at}: {file} has no section \"{section}\""));
                }
            }
        }
    }
    if n_cmds < 50 {
        wrong.push(format!(
            "only {n_cmds} memveil command lines found: the extractor is broken"
        ));
    }
    wrong
}

#[test]
fn docs_command_lines_links_and_sections_agree_with_the_code() {
    let mut cli = crate::Cli::command();
    cli.build();
    let wrong = problems(&repo(), &markdown_files(), &cli);
    assert!(
        wrong.is_empty(),
        "{} problems:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// The checker itself: it catches each kind of mistake (issue 35's).
#[test]
fn the_doc_checker_catches_a_wrong_flag_subcommand_link_anchor_and_section() {
    let mut cli = crate::Cli::command();
    cli.build();
    let check = |line: &str| check_command(&cli, &commands(line)[0]);
    assert_eq!(
        check("memveil vault serve --vault /run/memveil/vault.sock &"),
        None
    );
    assert_eq!(
        check("memveil vault --vault S create app --kind p256"),
        None
    );
    assert_eq!(
        check("memveil run --window 4096 -- redis-server --port 1"),
        None
    );
    assert_eq!(check("memveil run python3 job.py --bogus"), None);
    assert!(commands("cargo test -p memveil --test shield_run").is_empty());
    assert!(
        check("memveil vault serve --socket /x").is_some(),
        "a hidden alias"
    );
    assert!(
        check("memveil probe --vault-socket /x").is_some(),
        "a hidden alias"
    );
    assert!(check("memveil run --windw 10 -- /bin/true").is_some());
    assert!(check("memveil vault crate app").is_some());
    assert_eq!(
        commands("echo x | memveil vault encrypt --key app | memveil vault decrypt --key app")
            .len(),
        2
    );
    let dir = std::env::temp_dir().join(format!("memveil-doccheck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("docs")).expect("dir");
    std::fs::write(dir.join("docs/a.md"), "# A\n\n## Data ring\n").expect("a.md");
    std::fs::write(
        dir.join("README.md"),
        "See [a](docs/a.md#data-ring), [b](docs/b.md), [c](docs/a.md#data-path),\n\
         docs/a.md, \"Data ring\" and docs/a.md, \"Data path\".\n",
    )
    .expect("README");
    let wrong = problems(&dir, &[PathBuf::from("README.md")], &cli);
    let _ = std::fs::remove_dir_all(&dir);
    let has = |s: &str| wrong.iter().any(|w| w.contains(s));
    assert!(has("docs/b.md does not exist"), "{wrong:?}");
    assert!(has("no heading #data-path"), "{wrong:?}");
    assert!(has("has no section \"Data path\""), "{wrong:?}");
    assert!(!has("data-ring") && !has("\"Data ring\""), "{wrong:?}");
}
