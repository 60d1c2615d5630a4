//! `memveil`: the command-line front end. It parses flags, calls a library
//! crate and prints; errors become exit codes here and nowhere else.

mod cmd;
#[cfg(test)]
mod doc_check;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// `memveil --help`, after the subcommands.
const AFTER_LONG_HELP: &str = "\
Each subcommand has a short -h (one line per option) and a long --help (the details
and examples).

Examples:
  memveil probe                                   # what this host offers, with evidence
  memveil run -- python3 job.py                   # a program's heap kept as ciphertext
  memveil shield status                           # every protected program on the host
  memveil vault serve &                           # the key vault
  memveil key program --keyid 5 --mode random     # a host KeyID, held by the vault
  memveil bench --only engine                     # one part's figures

See README.md and docs/.";

/// memveil protects data in use on Linux hosts: a software multi-key memory
/// encryption engine, a key vault in secret memory, an entropy service and a
/// probe of what the host offers.
#[derive(Parser)]
#[command(name = "memveil", version, about, long_about = None, after_long_help = AFTER_LONG_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// What memory protection this host really offers, with evidence.
    Probe(cmd::probe::Args),
    /// Entropy: read streams, run the FIPS 140-2 battery, serve EGD, feed the kernel.
    Rng(cmd::rng::Args),
    /// Key vault: serve keys from secret memory, manage keys, encrypt and decrypt.
    Vault(cmd::vault::Args),
    /// Host key table (TME-MK's KeyIDs), held by the vault: program, clear, status.
    #[command(long_about = cmd::key::ABOUT, after_long_help = cmd::key::AFTER_LONG_HELP)]
    Key(cmd::key::Args),
    /// SSH agent whose keys live in the vault (ssh-add, ssh, ssh-keygen -Y sign)
    Agent(cmd::agent::Args),
    /// Encrypted disk whose key stays in the vault (FUSE file, loop device)
    ///
    /// Encrypted disk: an aes-xts-plain64 image whose key stays in the vault,
    /// served as a file in a FUSE mount and a loop device.
    #[command(verbatim_doc_comment)]
    Disk(cmd::disk::Args),
    /// Find AES key schedules (or a byte pattern) in a process, core file or memory image.
    Keyfind(cmd::keyfind::Args),
    /// Run an unmodified program with its heap kept as ciphertext outside a plaintext window.
    Run(cmd::run::Args),
    /// The host's shield: every protected program, and the budget they share.
    Shield(cmd::shield::Args),
    /// Run the benchmark suite and write a report.
    Bench(cmd::bench::Args),
    /// Write the man pages and shell completions (scripts/package.sh).
    #[command(hide = true)]
    PackageFiles(cmd::package_files::Args),
}

/// `memveil run` alone: what [`main`] parses `memveil run ...` with first.
/// The whole command line's definition (every subcommand's options and
/// help) took about 80 page faults of heap and 0.4 ms of `memveil run`'s
/// start, which every protected program pays (issue 34); a command line this
/// parser refuses (`--help` included) is parsed again by [`Cli`], which
/// answers as it always did.
#[derive(Parser)]
#[command(name = "memveil", version)]
struct RunCli {
    #[command(subcommand)]
    command: RunOnly,
}

#[derive(Subcommand)]
enum RunOnly {
    Run(cmd::run::Args),
}

/// The command line, parsed.
fn parse() -> Command {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match parse_run(&argv) {
        Some(a) => Command::Run(a),
        None => Cli::parse_from(argv).command,
    }
}

/// `memveil run ...` parsed by [`RunCli`]; `None` for any other command
/// line, or one it refuses.
fn parse_run(argv: &[std::ffi::OsString]) -> Option<cmd::run::Args> {
    if argv.get(1).is_none_or(|a| a != "run") {
        return None;
    }
    RunCli::try_parse_from(argv).ok().map(|c| match c.command {
        RunOnly::Run(a) => a,
    })
}

fn main() -> ExitCode {
    // The release profile unwinds (for the PKCS#11 module); this binary's
    // daemons abort on a panic, as with panic = "abort".
    memveil_sys::process::abort_on_panic();
    let r = match parse() {
        Command::Probe(a) => cmd::probe::run(a),
        Command::Rng(a) => cmd::rng::run(a),
        Command::Vault(a) => cmd::vault::run(a),
        Command::Key(a) => cmd::key::run(a),
        Command::Agent(a) => cmd::agent::run(a),
        Command::Disk(a) => cmd::disk::run(a),
        Command::Keyfind(a) => cmd::keyfind::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Shield(a) => cmd::shield::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::PackageFiles(a) => {
            cmd::package_files::run(&a, <Cli as clap::CommandFactory>::command())
        }
    };
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("memveil: error: {}", chain_once(&e));
            ExitCode::from(1)
        }
    }
}

/// The error and its causes joined by `: `, each cause once: an error whose
/// message already quotes its source (thiserror's `{source}`) would
/// otherwise print it twice, as `{e:#}` does.
fn chain_once(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if msg.contains(&c) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&c);
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::{chain_once, Cli};
    use clap::{CommandFactory as _, Parser as _};

    /// An error that quotes its source in its message (as thiserror's
    /// `#[error("{what}: {source}")]` does).
    #[derive(Debug)]
    struct Quoting(std::io::Error);
    impl std::fmt::Display for Quoting {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "/proc/999999/maps: {}", self.0)
        }
    }
    impl std::error::Error for Quoting {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// Issue 35: "…maps: No such file or directory (os error 2): No such file
    /// or directory (os error 2)".
    #[test]
    fn an_error_cause_prints_once() {
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        let e = anyhow::Error::new(Quoting(io)).context("no process 999999");
        let m = chain_once(&e);
        assert_eq!(m.matches("(os error 2)").count(), 1, "{m}");
        assert!(
            m.starts_with("no process 999999: /proc/999999/maps: "),
            "{m}"
        );
    }

    /// Issue 35: one name for the vault's socket, `--vault`, in `key` and
    /// `probe` too (the old spellings are hidden aliases).
    #[test]
    fn key_and_probe_take_vault_and_their_old_spellings() {
        for argv in [
            &["memveil", "key", "status", "--vault", "/v"][..],
            &["memveil", "key", "--socket", "/v", "status"][..],
            &[
                "memveil",
                "probe",
                "--serve",
                "127.0.0.1:0",
                "--vault",
                "/v",
            ][..],
            &[
                "memveil",
                "probe",
                "--serve",
                "127.0.0.1:0",
                "--vault-socket",
                "/v",
            ][..],
        ] {
            assert!(Cli::try_parse_from(argv).is_ok(), "{argv:?}");
        }
    }

    /// Issue 35: `memveil run --windw 10 -- /bin/true` took `--windw` for the
    /// program; an option before the program is memveil's and checked, one
    /// after it is the program's.
    #[test]
    fn run_refuses_an_unknown_option_before_the_program_and_passes_the_programs_own() {
        let e = Cli::try_parse_from(["memveil", "run", "--windw", "10", "--", "/bin/true"])
            .err()
            .expect("refused");
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
        let text = e.to_string();
        assert!(text.contains("--window"), "{text}");
        // A negative number is still a value, for the option to judge.
        let e = Cli::try_parse_from(["memveil", "run", "--max-overhead", "-5", "--", "true"])
            .err()
            .expect("refused");
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
        for argv in [
            &["memveil", "run", "--", "prog", "--x", "-y"][..],
            &["memveil", "run", "prog", "--x", "-y"][..],
            &["memveil", "run", "--window", "4", "prog", "--", "--x", "-y"][..],
        ] {
            let cli = Cli::try_parse_from(argv).expect("parsed");
            let super::Command::Run(a) = cli.command else {
                panic!("not run")
            };
            let args = a.program_and_args();
            assert_eq!(args[0], "prog", "{argv:?}");
            assert!(
                args.iter().any(|x| x == "--x") && args.iter().any(|x| x == "-y"),
                "{argv:?}: {args:?}"
            );
        }
    }

    /// Issue 34: `memveil run` is parsed by a parser of `run` alone; it
    /// accepts exactly what the whole command line's accepts, with the same
    /// result, and leaves the rest (help, errors) to it.
    #[test]
    fn run_alone_parses_as_the_whole_command_line_does() {
        use super::{parse_run, RunCli};
        let accepted: &[&[&str]] = &[
            &["memveil", "run", "--", "/bin/true"],
            &["memveil", "run", "true"],
            &[
                "memveil",
                "run",
                "--quiet",
                "--stats-json",
                "/tmp/j",
                "--",
                "sort",
                "-S",
                "1G",
            ],
            &[
                "memveil",
                "run",
                "--max-overhead",
                "1",
                "--",
                "prog",
                "--x",
                "-y",
            ],
            &["memveil", "run", "--window", "4", "prog", "--", "--x", "-y"],
            &[
                "memveil",
                "run",
                "--max-plaintext",
                "25%",
                "--cpu",
                "1",
                "--",
                "sh",
                "-c",
                "x",
            ],
            &[
                "memveil", "run", "--keyid", "5", "--vault", "/v", "--user", "nobody", "--", "id",
            ],
        ];
        for argv in accepted {
            let full = Cli::command()
                .try_get_matches_from(*argv)
                .expect("the whole command line accepts it");
            let alone = RunCli::command()
                .try_get_matches_from(*argv)
                .expect("run alone accepts it");
            assert_eq!(
                full.subcommand_matches("run"),
                alone.subcommand_matches("run"),
                "{argv:?}"
            );
            let os: Vec<std::ffi::OsString> = argv.iter().map(Into::into).collect();
            let a = parse_run(&os).expect("taken by the fast path");
            let super::Command::Run(b) = Cli::try_parse_from(*argv).expect("parsed").command else {
                panic!("not run")
            };
            assert_eq!(a.program_and_args(), b.program_and_args(), "{argv:?}");
        }
        // Refused by both, or help: left to the whole command line.
        let refused: &[&[&str]] = &[
            &["memveil", "run", "--windw", "10", "--", "/bin/true"],
            &["memveil", "run", "--max-overhead", "-5", "--", "true"],
            &[
                "memveil",
                "run",
                "--window",
                "4",
                "--max-plaintext",
                "5%",
                "--",
                "true",
            ],
            &["memveil", "run", "--help"],
            &["memveil", "run", "-h"],
            &["memveil", "run"],
            &["memveil", "--version"],
            &["memveil", "probe"],
            &["memveil"],
        ];
        for argv in refused {
            let os: Vec<std::ffi::OsString> = argv.iter().map(Into::into).collect();
            assert!(parse_run(&os).is_none(), "{argv:?}");
        }
        // Positive control: what the whole command line parses as `probe`
        // is not `run`'s.
        assert!(Cli::try_parse_from(["memveil", "probe"]).is_ok());
    }

    /// Every subcommand under `cmd`, depth first, with its path.
    fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<(String, clap::Command)>) {
        for sub in cmd
            .get_subcommands()
            .filter(|s| s.get_name() != "help" && !s.is_hide_set())
        {
            let p = format!("{path} {}", sub.get_name());
            out.push((p.clone(), sub.clone()));
            walk(sub, &p, out);
        }
    }

    #[test]
    fn every_subcommand_has_a_one_line_per_option_h_and_examples_in_its_help() {
        let mut root = Cli::command();
        root.build();
        let mut all = vec![("memveil".to_owned(), root.clone())];
        walk(&root, "memveil", &mut all);
        assert!(all.len() > 20, "{} commands", all.len());
        let mut wrong = Vec::new();
        for (path, mut cmd) in all {
            let short = cmd.render_help().to_string();
            let long = cmd.render_long_help().to_string();
            // clap puts an option's help on a line of its own (indented by
            // ten) when one of them does not fit beside its flag.
            wrong.extend(
                short
                    .lines()
                    .filter(|l| l.chars().count() > 100 || l.starts_with("          "))
                    .map(|l| format!("`{path} -h`: not one line per option in 100 columns: {l}")),
            );
            // Issue 35: --help fits 100 columns too (examples wrapped with \).
            wrong.extend(
                long.lines()
                    .filter(|l| l.chars().count() > 100)
                    .map(|l| format!("`{path} --help`: over 100 columns: {l}")),
            );
            if !long.contains("\nExamples:\n  ") {
                wrong.push(format!("`{path} --help` ends without examples"));
            }
            if long.lines().count() < short.lines().count() {
                wrong.push(format!("`{path} --help` says less than -h"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}
