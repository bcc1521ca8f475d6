/* The four C23 entry points the llama-cpp-py-sync wheel's libraries take from glibc 2.38, forwarded to their
   older equivalents, for machines whose glibc is older (bench/llama_cpp/setup.sh builds and preloads this
   after weak_glibc_2_38.py marks the libraries' need of GLIBC_2.38 weak). They differ from the forwarded
   functions only in accepting C23's 0b binary prefix, which llama.cpp's callers here do not read. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
unsigned long __isoc23_strtoul(const char *s, char **end, int base) { return strtoul(s, end, base); }
unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }

int __isoc23_sscanf(const char *s, const char *format, ...) {
    va_list arguments;
    va_start(arguments, format);
    int read = vsscanf(s, format, arguments);
    va_end(arguments);
    return read;
}
