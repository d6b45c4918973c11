"""Plain implementations that set the speed bar: what a user would write in a few lines."""
