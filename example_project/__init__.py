"""An example shop whose payments are charged once per order, however often the task arrives."""
