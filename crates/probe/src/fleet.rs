//! What a fleet's Prometheus reads of one host besides the probe's facts:
//! the key vault's and the entropy service's counters, read live on every
//! scrape (the `memveil` binary fills these from the vault's control socket
//! and `memveil rng serve --stats`), and the exposition of all of it.
//!
//! A daemon that is configured but cannot be read is still exported: its
//! `_up` gauge is 0 (the alert "vault down" reads it), the rest absent.

use crate::exposition::{flag, Kind, Writer};
use crate::report::Report;

/// The vault's counters, from its `Status` and host key table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VaultCounters {
    /// Protection level of its keys ("secret" or "locked").
    pub level: String,
    /// AES backend.
    pub backend: String,
    /// Keys held (all owners).
    pub keys: u64,
    /// Connected clients (this scrape's included).
    pub clients: u64,
    /// Whether a keystore is configured (persistent keys possible).
    pub durable: bool,
    /// Seconds since the vault started.
    pub uptime_s: u64,
    /// KeyIDs `1..=max_keyid` are programmable.
    pub max_keyid: u64,
    /// KeyIDs programmed now (not clear).
    pub keyids_programmed: u64,
    /// Running tenants (`memveil run --keyid`) by KeyID, for the KeyIDs
    /// programmed or cleared since start; `None` from a vault that predates
    /// the count.
    pub tenants: Option<Vec<(u16, u64)>>,
}

/// The entropy service's counters (`memveil rng serve --stats`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RngCounters {
    /// Whether a seed source is healthy and serving.
    pub source_healthy: bool,
    /// Seeds produced (16 bytes each).
    pub seeds_produced: u64,
    /// Bytes served to all consumers.
    pub bytes_served: u64,
    /// Consumers connected now.
    pub consumers_open: u64,
    /// Consumers ever connected.
    pub consumers_total: u64,
    /// Connections refused over the consumer limit.
    pub consumers_refused: u64,
    /// Seconds since it started.
    pub uptime_s: f64,
}

/// What one scrape exports: the facts, then each daemon asked for (`Err`
/// with why when it could not be read; that reason is not exported, the
/// caller logs it).
#[derive(Debug, Clone, Copy)]
pub struct Scrape<'a> {
    /// The probe's report.
    pub report: &'a Report,
    /// The vault, unless the host runs none (`--no-vault`).
    pub vault: Option<&'a Result<VaultCounters, String>>,
    /// The entropy service, when asked for (`--rng-stats`).
    pub rng: Option<&'a Result<RngCounters, String>>,
    /// When the facts were collected (Unix seconds).
    pub facts_time: f64,
    /// How long collecting them took, seconds.
    pub facts_seconds: f64,
}

/// The whole exposition: the probe's families ([`crate::render::prometheus`]),
/// then the facts' age, the vault's and the entropy service's.
#[must_use]
pub fn exposition(s: &Scrape<'_>) -> String {
    let mut w = Writer::new();
    crate::render::named(s.report, &mut w);
    w.single(
        "memveil_probe_facts_timestamp_seconds",
        Kind::Gauge,
        "When memveil probe last collected the host's facts (Unix time).",
        s.facts_time,
    );
    w.single(
        "memveil_probe_collect_seconds",
        Kind::Gauge,
        "How long memveil probe took to collect the host's facts.",
        s.facts_seconds,
    );
    if let Some(v) = s.vault {
        vault(&mut w, v.as_ref().ok());
    }
    if let Some(r) = s.rng {
        rng(&mut w, r.as_ref().ok());
    }
    crate::render::generic(s.report, &mut w);
    w.finish()
}

#[allow(clippy::cast_precision_loss)]
fn vault(w: &mut Writer, v: Option<&VaultCounters>) {
    w.single(
        "memveil_vault_up",
        Kind::Gauge,
        "1 when the key vault answered on its control socket, 0 when it could not be reached.",
        flag(v.is_some()),
    );
    let Some(v) = v else { return };
    w.family(
        "memveil_vault_info",
        Kind::Gauge,
        "The key vault's protection level (secret: memfd_secret, locked: mlock only) and AES backend.",
    )
    .sample(
        &[("level", &v.level), ("backend", &v.backend)],
        1.0,
    );
    w.single(
        "memveil_vault_keys",
        Kind::Gauge,
        "Keys the vault holds (all owners).",
        v.keys as f64,
    );
    w.single(
        "memveil_vault_clients",
        Kind::Gauge,
        "Clients connected to the vault (this scrape's included).",
        v.clients as f64,
    );
    w.single(
        "memveil_vault_durable",
        Kind::Gauge,
        "1 when the vault has a keystore (persistent keys possible).",
        flag(v.durable),
    );
    w.single(
        "memveil_vault_uptime_seconds",
        Kind::Gauge,
        "Seconds since the vault started (a drop is a restart: the host key table was cleared).",
        v.uptime_s as f64,
    );
    w.single(
        "memveil_vault_keyids_max",
        Kind::Gauge,
        "KeyIDs of the host key table that can be programmed (1..=max).",
        v.max_keyid as f64,
    );
    w.single(
        "memveil_vault_keyids_programmed",
        Kind::Gauge,
        "KeyIDs of the host key table programmed now (random, direct or no-encrypt).",
        v.keyids_programmed as f64,
    );
    if let Some(t) = &v.tenants {
        w.single(
            "memveil_vault_tenants",
            Kind::Gauge,
            "Programs running as tenants of host KeyIDs (memveil run --keyid).",
            t.iter().map(|(_, n)| *n).sum::<u64>() as f64,
        );
        w.family(
            "memveil_vault_keyid_tenants",
            Kind::Gauge,
            "Tenants running under each KeyID programmed or cleared since the vault started.",
        );
        for (keyid, n) in t {
            w.sample(&[("keyid", &keyid.to_string())], *n as f64);
        }
    }
}

#[allow(clippy::cast_precision_loss)]
fn rng(w: &mut Writer, r: Option<&RngCounters>) {
    w.single(
        "memveil_rng_serve_up",
        Kind::Gauge,
        "1 when the entropy service (memveil rng serve) answered on its stats socket, 0 when not.",
        flag(r.is_some()),
    );
    let Some(r) = r else { return };
    w.single(
        "memveil_rng_serve_source_healthy",
        Kind::Gauge,
        "1 when the entropy service has a healthy seed source (0: every source quarantined, nothing served).",
        flag(r.source_healthy),
    );
    w.single(
        "memveil_rng_serve_bytes_served_total",
        Kind::Counter,
        "Random bytes the entropy service delivered to its consumers.",
        r.bytes_served as f64,
    );
    w.single(
        "memveil_rng_serve_seeds_produced_total",
        Kind::Counter,
        "Seeds (16 bytes) the entropy service's pool produced.",
        r.seeds_produced as f64,
    );
    w.single(
        "memveil_rng_serve_consumers",
        Kind::Gauge,
        "Consumers (VMs, EGD clients) connected now.",
        r.consumers_open as f64,
    );
    w.single(
        "memveil_rng_serve_consumers_total",
        Kind::Counter,
        "Consumers ever connected.",
        r.consumers_total as f64,
    );
    w.single(
        "memveil_rng_serve_consumers_refused_total",
        Kind::Counter,
        "Connections refused over the consumer limit.",
        r.consumers_refused as f64,
    );
    w.single(
        "memveil_rng_serve_uptime_seconds",
        Kind::Gauge,
        "Seconds since the entropy service started.",
        r.uptime_s,
    );
}
