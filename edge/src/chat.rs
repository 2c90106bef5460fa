//! Chat templates as programs of pieces (router/edge_template.py derives them from the
//! model's Jinja template and checks them against it).

/// `kvserve-edge chat`: test driver (JSON lines).
pub fn cli(_args: &[String]) -> i32 {
    todo!("chat cli")
}
