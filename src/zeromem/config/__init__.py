"""DeepSpeed-compatible configuration: the strict schema (`schema`), the rules that resolve
batch sizes and `auto` values (`rules`), and which keys are read, refused or warned about
(`support`).
"""
