//! Requests the edge does not serve natively, passed to the Python router unchanged.
