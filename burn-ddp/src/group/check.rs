//! The argument checks every backend makes before a collective; `Some(message)` when the call
//! is wrong on this rank alone (pure).

pub fn root(root: usize, world: usize) -> Option<String> {
    (root >= world).then(|| format!("root {root} is not a rank of this group (world size {world})"))
}

pub fn all_gather(world: usize, input: usize, output: usize) -> Option<String> {
    (output != world * input).then(|| {
        format!(
            "output has {output} elements, expected world size x input = {}",
            world * input
        )
    })
}

pub fn blocks(world: usize, counts: &[usize], len: usize) -> Option<String> {
    if counts.len() != world {
        return Some(format!(
            "{} block sizes given, expected one per rank (world size {world})",
            counts.len()
        ));
    }
    let total: usize = counts.iter().sum();
    (total != len)
        .then(|| format!("the buffer has {len} elements but the block sizes add up to {total}"))
}

pub fn reduce_scatter(world: usize, input: usize, output: usize) -> Option<String> {
    (input != world * output).then(|| {
        format!(
            "input has {input} elements, expected world size x output = {}",
            world * output
        )
    })
}
