//! The one place memveil names its AES backend: XTS, ECB, CBC, CTR, GCM.
