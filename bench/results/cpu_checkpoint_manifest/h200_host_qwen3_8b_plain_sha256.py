import hashlib,time,json,os,torch
from safetensors.torch import save_file
d="/tmp/ck";os.makedirs(d,exist_ok=True)
H,I,L=4096,12288,5
sh={"fc":(H,L*H)}
for i in range(L):
  for n,s in {"q":(H,H),"k":(1024,H),"v":(1024,H),"o":(H,H),"g":(I,H),"u":(I,H),"d":(H,I)}.items(): sh[f"{i}.{n}"]=s
w={k:torch.randn(s) for k,s in sh.items()}
n=sum(t.numel() for t in w.values())
r={"params":n}
t=time.perf_counter();save_file(w,d+"/w.safetensors");r["save_weights_s"]=time.perf_counter()-t
st={"state":{i:{"exp_avg":v,"exp_avg_sq":v.clone()} for i,v in enumerate(w.values())}}
t=time.perf_counter();torch.save(st,d+"/opt.pt");r["save_opt_s"]=time.perf_counter()-t
del st,w
def sha(p):
  h=hashlib.sha256()
  with open(p,"rb") as f:
    while c:=f.read(8<<20): h.update(c)
  return h.hexdigest()
tot=0;t=time.perf_counter()
for f in ("w.safetensors","opt.pt"): sha(d+"/"+f);tot+=os.path.getsize(d+"/"+f)
r["sha_s"]=time.perf_counter()-t;r["gb"]=tot/1e9;r["gb_per_s"]=tot/1e9/r["sha_s"]
os.system("sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null")
t=time.perf_counter()
for f in ("w.safetensors","opt.pt"): sha(d+"/"+f)
r["sha_after_drop_caches_s"]=time.perf_counter()-t
print(json.dumps(r))
json.dump(r,open(os.environ["OUT"]+"/qwen3_8b_sha.json","w"),indent=1)
