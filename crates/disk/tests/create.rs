//! Concurrent `create`s on one image: one binds it, the others are refused
//! with an error that names the cause and the fix, and the binding on disk
//! is the winner's. Before the binding's lock, each create checked for a
//! binding and then renamed its own over whatever was there: two at once
//! both succeeded and the last one's binding replaced the other's in
//! silence (or the loser failed on the other's temporary file, or on the
//! image the other had just made, with an error naming neither).
//!
//! Plain images (no vault): the race is in the check and the publish, which
//! are the same for every cipher.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use memveil_disk::{Binding, Cipher, CreateOpts, DiskError, KeySource};
use memveil_vault::proto::KeyKind;

#[test]
fn child() {
    common::child_main();
}

const CREATORS: usize = 3;
const ROUNDS: usize = 300;

/// Creator `i`'s request: each binds the image differently (its sector size
/// and IV numbering, or the size of the image it makes), so whose binding
/// is on disk shows.
fn opts(image: &Path, i: usize, image_exists: bool) -> CreateOpts {
    let (sector_size, iv_large_sectors) = [(512, false), (4096, false), (4096, true)][i];
    CreateOpts {
        image: image.to_path_buf(),
        size: (!image_exists).then_some(64 << 10 << i),
        cipher: Cipher::Plain,
        vault: None,
        key: String::new(),
        source: KeySource::New,
        key_kind: KeyKind::Xts128,
        persistent: false,
        sector_size,
        iv_large_sectors,
    }
}

/// One round: `CREATORS` threads released at once on one image.
fn round(dir: &Path, n: usize) -> Vec<Result<Binding, DiskError>> {
    let image: PathBuf = dir.join(format!("r{n}.img"));
    // Even rounds adopt an image that is there, odd ones make it.
    let exists = n.is_multiple_of(2);
    if exists {
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(256 << 10))
            .expect("image");
    }
    let start = Arc::new(Barrier::new(CREATORS));
    let threads: Vec<_> = (0..CREATORS)
        .map(|i| {
            let o = opts(&image, i, exists);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                memveil_disk::create(&o)
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("creator panicked"))
        .collect()
}

#[test]
fn concurrent_creates_on_one_image_bind_it_once_and_refuse_the_rest() {
    let dir = common::scratch("create-race");
    let mut refused_while_held = 0;
    for n in 0..ROUNDS {
        let results = round(&dir, n);
        let image = dir.join(format!("r{n}.img"));
        let won: Vec<&Binding> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        let lost: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            won.len(),
            1,
            "round {n}: {} creates succeeded on one image (refused: {lost:?})",
            won.len()
        );
        for e in &lost {
            // The cause and the fix, whichever the loser met.
            let held = e.contains("another `memveil disk create` is binding")
                && e.contains("memveil disk info");
            let bound = e.contains("the image is bound already");
            assert!(held || bound, "round {n}: unclear refusal: {e}");
            refused_while_held += usize::from(held);
        }
        let on_disk = memveil_disk::read_binding(&image).expect("binding");
        assert_eq!(
            on_disk.encode(),
            won[0].encode(),
            "round {n}: the binding on disk is not the winner's"
        );
        let len = std::fs::metadata(&image).expect("image").len();
        assert_eq!(len, won[0].geometry.size, "round {n}: image size");
        for left in [".memveil-disk.tmp", ".memveil-disk.lock"] {
            let mut p = image.clone().into_os_string();
            p.push(left);
            assert!(
                !Path::new(&p).exists(),
                "round {n}: {} left behind",
                Path::new(&p).display()
            );
        }
    }
    eprintln!(
        "{ROUNDS} rounds of {CREATORS} creates: {refused_while_held} refused while another held \
         the lock, the rest after the binding was written"
    );
}

#[test]
fn a_key_left_without_a_binding_is_named_and_can_be_bound() {
    // A create killed after it made the key in the vault and before it
    // wrote the binding: the key is there, the binding is not. The retry
    // was refused with the vault's words alone ("a key named ... exists").
    let dir = common::scratch("orphan");
    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = dir.join("o.img");
    let mut c = memveil_vault::Client::connect(&sock).expect("connect");
    c.create_key("orphan", KeyKind::Xts128, false)
        .expect("the key a killed create made");
    let o = common::image_opts(&image, &sock, "orphan", 1 << 20);
    let e = memveil_disk::create(&o).expect_err("the name is taken");
    let m = e.to_string();
    assert!(
        m.contains("\"orphan\" exists")
            && m.contains("has no binding")
            && m.contains("--existing-key"),
        "{m}"
    );
    assert!(
        !memveil_disk::binding::path_for(&image).exists(),
        "refused: no binding"
    );
    // The fix the message names binds the image to that key.
    let b = memveil_disk::create(&CreateOpts {
        source: KeySource::Existing,
        ..o
    })
    .expect("bound to the existing key");
    assert_eq!(b.key, "orphan");
    assert_eq!(
        memveil_disk::read_binding(&image).expect("binding").key,
        "orphan"
    );
}
