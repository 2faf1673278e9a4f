"""The REST API's JSON parser."""

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser as RestFrameworkJSONParser


class JSONParser(RestFrameworkJSONParser):
    """DRF's, except that JSON nested past Python's recursion limit (`[[[[...`, a few
    bytes a level) is a 400 like any other malformed body, not a 500."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError as exc:
            raise ParseError("JSON parse error - nested too deeply") from exc
