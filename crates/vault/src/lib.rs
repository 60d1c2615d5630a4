//! Key vault daemon: keys that live only in memfd_secret memory, served over a Unix socket and shared-memory rings.
