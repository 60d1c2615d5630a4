//! Entropy: RDRAND/RDSEED sources, conditioning, health tests, CTR_DRBG, FIPS 140-2 battery, EGD.
