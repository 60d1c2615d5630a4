//! Transparent protection of unmodified programs' memory: ranges kept as ciphertext, decrypted on touch.
