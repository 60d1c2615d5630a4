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

/// One program under `memveil run` (`memveil shield status`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShieldProgram {
    /// The pid of its `memveil run`.
    pub pid: u32,
    /// The user it runs as.
    pub user: String,
    /// Its command line.
    pub command: String,
    /// Its host KeyID (`--keyid`).
    pub keyid: Option<u16>,
    /// The guarantee (`budget 10%`, `bound`, ...).
    pub guarantee: String,
    /// Whether any of its processes runs the shield.
    pub protected: bool,
    /// Bytes of its heap holding data now.
    pub heap_bytes: u64,
    /// Ciphertext over data, time-weighted over the run.
    pub ciphertext_fraction: Option<f64>,
    /// What the shield cost it, as a share of its time.
    pub cost_fraction: Option<f64>,
    /// Faults served.
    pub faults: u64,
    /// Whether its budget was kept (`None`: no budget or not measured yet).
    pub budget_met: Option<bool>,
    /// Whether it draws on the host's budget.
    pub on_host_budget: bool,
}

/// The host's shield: the budget every program shares and the programs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShieldHost {
    /// The host's budget as a share of its CPU time (0: off; `None`: no
    /// ledger).
    pub budget_fraction: Option<f64>,
    /// What the programs drew from it over the last second, as a share of
    /// the host's CPU time.
    pub spent_fraction: Option<f64>,
    /// Every protected program.
    pub programs: Vec<ShieldProgram>,
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
    /// The host's shield (`memveil shield status`).
    pub shield: Option<&'a ShieldHost>,
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
    if let Some(h) = s.shield {
        shield(&mut w, h);
    }
    crate::render::generic(s.report, &mut w);
    w.finish()
}

/// The command as a label: at most 80 characters.
fn short(command: &str) -> String {
    command.chars().take(80).collect()
}

#[allow(clippy::cast_precision_loss)]
fn shield(w: &mut Writer, h: &ShieldHost) {
    w.single(
        "memveil_shield_programs",
        Kind::Gauge,
        "Programs running under memveil run on this host (memveil shield status).",
        h.programs.len() as f64,
    );
    if let Some(b) = h.budget_fraction {
        w.single(
            "memveil_shield_host_budget_fraction",
            Kind::Gauge,
            "The host's shield budget: the share of the host's CPU time all protected programs' faults and sweeps may take together (0: off).",
            b,
        );
    }
    if let Some(f) = h.spent_fraction {
        w.single(
            "memveil_shield_host_spent_fraction",
            Kind::Gauge,
            "What the protected programs drew from the host's budget over the last second, as a share of the host's CPU time.",
            f,
        );
    }
    w.single(
        "memveil_shield_host_budget_programs",
        Kind::Gauge,
        "Protected programs drawing on the host's budget (the others keep their own budget only).",
        h.programs.iter().filter(|p| p.on_host_budget).count() as f64,
    );
    let labels = |p: &ShieldProgram| -> [(&'static str, String); 5] {
        [
            ("pid", p.pid.to_string()),
            ("user", p.user.clone()),
            ("command", short(&p.command)),
            ("keyid", p.keyid.map(|k| k.to_string()).unwrap_or_default()),
            ("guarantee", p.guarantee.clone()),
        ]
    };
    type Value = fn(&ShieldProgram) -> Option<f64>;
    let families: [(&str, Kind, &str, Value); 7] = [
        (
            "memveil_shield_program_protected",
            Kind::Gauge,
            "1 when the program's processes run the shield, 0 when none does (the preload never loaded, or a no-encrypt KeyID): its memory is plaintext.",
            |p| Some(flag(p.protected)),
        ),
        (
            "memveil_shield_program_heap_bytes",
            Kind::Gauge,
            "Bytes of the program's heap holding data now (plaintext and ciphertext).",
            |p| Some(p.heap_bytes as f64),
        ),
        (
            "memveil_shield_program_ciphertext_fraction",
            Kind::Gauge,
            "Share of the program's heap held as ciphertext, weighted by time over its run.",
            |p| p.ciphertext_fraction,
        ),
        (
            "memveil_shield_program_cost_fraction",
            Kind::Gauge,
            "What faults and sweeps cost the program, as a share of its time.",
            |p| p.cost_fraction,
        ),
        (
            "memveil_shield_program_faults_total",
            Kind::Counter,
            "Faults the program's shield served.",
            |p| Some(p.faults as f64),
        ),
        (
            "memveil_shield_program_budget_met",
            Kind::Gauge,
            "1 when the program's cost stayed within its budget (--max-overhead), 0 when not.",
            |p| p.budget_met.map(flag),
        ),
        (
            "memveil_shield_program_on_host_budget",
            Kind::Gauge,
            "1 when the program draws on the host's budget, 0 when on its own budget only.",
            |p| Some(flag(p.on_host_budget)),
        ),
    ];
    for (name, kind, help, value) in families {
        if !h.programs.iter().any(|p| value(p).is_some()) {
            continue;
        }
        w.family(name, kind, help);
        for p in &h.programs {
            if let Some(v) = value(p) {
                let l = labels(p);
                let l: Vec<(&str, &str)> = l.iter().map(|(k, v)| (*k, v.as_str())).collect();
                w.sample(&l, v);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shield_is_exported_per_program_and_for_the_host() {
        let p = ShieldProgram {
            pid: 42,
            user: "alice".into(),
            command: "python3 -c \"x\"\nprint(1)".into(),
            keyid: Some(5),
            guarantee: "budget 10%".into(),
            protected: true,
            heap_bytes: 4096,
            ciphertext_fraction: Some(0.75),
            cost_fraction: Some(0.04),
            faults: 7,
            budget_met: Some(false),
            on_host_budget: true,
        };
        let unprotected = ShieldProgram {
            pid: 43,
            protected: false,
            ..ShieldProgram::default()
        };
        let h = ShieldHost {
            budget_fraction: Some(0.05),
            spent_fraction: Some(0.01),
            programs: vec![p, unprotected],
        };
        let mut w = Writer::new();
        shield(&mut w, &h);
        let t = w.finish();
        let l = r#"{pid="42",user="alice",command="python3 -c \"x\"\nprint(1)",keyid="5",guarantee="budget 10%"}"#;
        for want in [
            "memveil_shield_programs 2".to_owned(),
            "memveil_shield_host_budget_fraction 0.05".to_owned(),
            "memveil_shield_host_budget_programs 1".to_owned(),
            format!("memveil_shield_program_budget_met{l} 0"),
            format!("memveil_shield_program_ciphertext_fraction{l} 0.75"),
            format!("memveil_shield_program_faults_total{l} 7"),
            r#"memveil_shield_program_protected{pid="43",user="",command="",keyid="",guarantee=""} 0"#
                .to_owned(),
        ] {
            assert!(t.contains(&want), "{want} missing from\n{t}");
        }
        // No budget measured: no sample rather than a made-up one.
        assert!(!t.contains(r#"memveil_shield_program_budget_met{pid="43""#));
    }
}
