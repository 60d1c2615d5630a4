//! Allocates a secret region and prints its level or the error: a tiny
//! program the integration tests run under other users, limits and
//! environments. Usage: `secmem-probe BYTES secret|locked`.

use memveil_secmem::{Level, Policy, SecretPool};

fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let bytes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(4096);
    let weakest: Level = match args.next().as_deref().unwrap_or("secret").parse() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match SecretPool::new(bytes, Policy::allow(weakest)) {
        Ok(p) => {
            println!("level={}", p.level());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
