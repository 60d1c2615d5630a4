//! Without memfd_secret the engine refuses unless the weaker level is accepted.
//! (Alone in its test binary because it sets a process-wide variable.)

use memveil_engine::{Config, Engine, EngineError};
use memveil_secmem::{Level, Policy};

#[test]
fn refuses_without_secretmem_unless_locked_is_accepted() {
    std::env::set_var("MEMVEIL_SECRETMEM", "off");
    let r = Engine::new(Config {
        frames: 8,
        ..Config::default()
    });
    let msg = match r {
        Err(EngineError::Secmem(e)) => e.to_string(),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("engine started without secret memory under the default policy"),
    };
    assert!(msg.contains("--allow-level=locked"), "{msg}");
    let e = Engine::new(Config {
        frames: 8,
        policy: Policy::allow(Level::Locked),
        ..Config::default()
    })
    .expect("accepted weaker level");
    assert_eq!(e.level(), Level::Locked, "the level in use is reported");
}
