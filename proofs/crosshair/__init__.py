"""CrossHair: plain-assert contracts on the pure functions the library runs, spec/impl
`diffbehavior` pairs, planted bugs they must refute, and the bounded runner that replays every
counterexample (`python -m proofs.crosshair`)."""
