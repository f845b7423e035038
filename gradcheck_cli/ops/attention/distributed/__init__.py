"""Context-parallel attention on real ranks (``distributed:``): the ranks (:mod:`.ranks`, :mod:`.rank`), how a
sequence is split over them (:mod:`.sharding`), and the tool's own ring and Ulysses attention (:mod:`.ring`)."""
