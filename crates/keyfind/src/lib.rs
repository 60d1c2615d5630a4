//! Finds AES key schedules in memory images, process memory and core dumps.
