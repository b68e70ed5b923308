"""The eval program, COCO scoring and the ``validate``/``predict`` verbs."""
