// placeholder until the train concern lands
