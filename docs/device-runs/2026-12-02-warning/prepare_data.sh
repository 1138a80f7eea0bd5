# CPU machine, before the device calls (issue 33): the two texts of the grids, prepared here and carried
# (data/cache/ is ignored by git: `carry: ["data/cache/gcide", "data/cache/kjv8k"]`, ~26 MB together).
apt-get install -y dict-gcide   # the dictionary text of recipes/margin.yaml
zcat /usr/share/dictd/gcide.dict.dz | iconv -f latin1 -t utf-8 > /tmp/gcide.txt
python -m launcher.prepare_data --source /tmp/gcide.txt --out data/cache/gcide --vocab-size 8192
python -m launcher.prepare_data --source kjv --out data/cache/kjv8k --tokenizer bpe --vocab-size 8192  # the held-out text
