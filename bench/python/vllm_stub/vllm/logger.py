"""vllm.logger.init_logger: a standard logger with vLLM's *_once methods."""
import logging


class _Logger(logging.LoggerAdapter):
    _seen = set()

    def process(self, msg, kwargs):
        kwargs.pop("scope", None)
        return msg, kwargs

    def _once(self, level, msg, *args, **kwargs):
        key = (level, msg, args)
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args, **kwargs)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
