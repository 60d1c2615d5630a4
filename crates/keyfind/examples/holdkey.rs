//! Holds an AES key schedule in memory until stdin closes, for the key
//! finder's tests. `holdkey heap|secret HEXKEY`: `heap` expands the key with
//! memveil-cipher into ordinary heap memory (the unprotected baseline),
//! `secret` into a memfd_secret pool, `stack`
//! into a stack buffer that is dropped without being wiped. Prints `ready` when the key is in place.

use std::io::{BufRead as _, Write as _};

/// The careless-copy class: a schedule built in a stack buffer that is
/// dropped without being wiped stays in the stack mapping below the
/// stack pointer.
#[inline(never)]
fn careless_stack_copy(key: &[u8]) {
    // A deep frame, the schedule at its lowest address, so the calls made
    // later (printing, reading stdin) do not happen to overwrite it.
    let mut buf = [0u8; 64 * 1024];
    if let Some(s) = memveil_keyfind::expand(key) {
        let n = s.len().min(buf.len());
        buf[..n].copy_from_slice(&s[..n]);
    }
    std::hint::black_box(&buf);
}

fn main() -> Result<(), String> {
    let mut a = std::env::args().skip(1);
    let mode = a.next().unwrap_or_default();
    let hex = a.next().unwrap_or_default();
    let key: Vec<u8> = (0..hex.len() / 2)
        .map(|i| {
            u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("zz"), 16)
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut _heap = None;
    let mut _secret = None;
    let mut _pool = None;
    match mode.as_str() {
        "heap" => {
            _heap = Some(Box::new(
                memveil_cipher::Aes::new(&key).map_err(|e| e.to_string())?,
            ))
        }
        "secret" => {
            let pool = memveil_secmem::SecretPool::new(4096, memveil_secmem::Policy::secret_only())
                .map_err(|e| e.to_string())?;
            _secret = Some(
                pool.alloc(|| memveil_cipher::Aes::new(&key).ok())
                    .map_err(|e| e.to_string())?,
            );
            _pool = Some(pool);
        }
        "stack" => careless_stack_copy(&key),
        _ => return Err("usage: holdkey heap|secret|stack HEXKEY".into()),
    }
    // Forget the caller's copy of the raw key.
    drop(key);
    drop(hex);
    println!("ready");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    Ok(())
}
