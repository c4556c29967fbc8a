from setuptools import setup, Extension
setup(name="proto", ext_modules=[Extension("proto", ["proto.c"], extra_compile_args=["-O2"])])
