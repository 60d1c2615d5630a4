//! LD_PRELOAD library that puts an unmodified program's heap under memveil-shield.
