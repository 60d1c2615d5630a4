//! Software multi-key memory encryption engine: the model of Intel TME-MK and AMD SME/TSME.
