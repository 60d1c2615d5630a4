//! What memory protection a host really offers, with the evidence for each answer.
