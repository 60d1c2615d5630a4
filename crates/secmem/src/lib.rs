//! Secret memory: memfd_secret allocations that wipe on drop, with a reported protection level.
