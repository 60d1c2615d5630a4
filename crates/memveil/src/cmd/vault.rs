//! `memveil vault`: the key vault daemon (`serve`) and the verbs for people
//! (create/import/list/rotate/destroy/grant/revoke keys, encrypt/decrypt,
//! status). The flags and verbs live in `memveil_vault::cli`, shared with
//! the stand-alone `memveil-vault` binary.

/// Flags of `memveil vault`.
pub type Args = memveil_vault::cli::Args;

/// Runs `memveil vault`.
///
/// # Errors
/// Whatever the vault or the client reports, with its cause and fix.
pub fn run(args: Args) -> anyhow::Result<u8> {
    memveil_vault::cli::run(args).map_err(|e| anyhow::anyhow!("{e}"))
}
